"""lingctl: train, move, watch, checkpoint and serve Ling-style Mixture-of-Experts models."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``__version__`` is looked up on first use: importlib.metadata (and the email parser it loads) costs
    # ~25 ms, which every command would otherwise pay at start-up.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("lingctl")
        except PackageNotFoundError:  # running from a source tree that is not installed
            value = "0.0.0+source"
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module 'lingctl' has no attribute {name!r}")
