"""Where lingctl keeps its own state: ``$LINGCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/lingctl``, else
``~/.cache/lingctl``. One subdirectory per user of it: ``babel/`` (sync journals), ``pcache/`` (the flash tier
and upload notes), ``runs/`` (staging of ``s3://`` training runs), ``native/`` (flood's compiled kernels).

State stays out of users' trees (a destination holds only what was copied there). Callers that keep it in a
shared place check it with ``core.private_dir`` before use.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "LINGCTL_CACHE_DIR"


def cache_root() -> Path:
    """lingctl's cache directory (not created)."""
    explicit = os.environ.get(ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    # XDG says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "lingctl"


def cache_dir(name: str) -> Path:
    """The subdirectory ``name`` of the cache (not created)."""
    return cache_root() / name
