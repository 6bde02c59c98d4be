"""`lingctl version`."""

from __future__ import annotations

import platform

from lingctl.commands.options import JsonOpt
from lingctl.core.output import Output


def version(json: JsonOpt = False) -> None:
    """Print the lingctl version."""
    from lingctl import __version__

    Output(json).result({"lingctl": __version__, "python": platform.python_version()}, f"lingctl {__version__}")
