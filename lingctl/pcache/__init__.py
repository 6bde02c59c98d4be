"""lingctl pcache: checkpoint writes spread across nodes, a low-memory writer and a flash tier to remote storage.

The public names load on first use, so that importing the package (the command line does) does not import
torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PCacheSavePlanner": "lingctl.pcache.save_planner",
    "PCacheWriter": "lingctl.pcache.writer",
    "NodeThrottle": "lingctl.pcache.throttle",
    "Topology": "lingctl.pcache.topology",
    "Uploader": "lingctl.pcache.tier",
    "save": "lingctl.pcache.checkpoint",
    "load": "lingctl.pcache.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lingctl.pcache' has no attribute {name!r}")
    return getattr(import_module(module), name)
