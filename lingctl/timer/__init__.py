"""timer: selective low-overhead tracing of training processes; attach, diagnose, export."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lingctl.timer.tracer import install, uninstall

__all__ = ["install", "uninstall"]


def __getattr__(name: str):
    # Lazy, so that `import lingctl.timer` (readers, the CLI) stays cheap; the tracer itself imports torch
    # only once the traced program does.
    if name in __all__:
        from lingctl.timer import tracer

        return getattr(tracer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
