"""Tools whose command line is reserved but not yet part of this release.

Each is registered so that ``lingctl --help`` shows the whole toolkit, and so that calling one says plainly
that it is not available (exit 1) instead of failing as an unknown command. An entry moves out of here
into its own ``commands/<tool>.py`` when the tool lands.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from lingctl.core.errors import LingctlError

PLANNED: dict[str, str] = {
    "pcache": "Plan and run checkpoint writes spread across nodes, tiered to remote storage.",
}


def _placeholder(name: str) -> Callable[..., None]:
    def command(ctx: typer.Context) -> None:
        raise LingctlError(f"'lingctl {name}' is not available in this release yet",
                           hint="see docs/index.md for the tools that are")

    command.__doc__ = f"{PLANNED[name]} (not available in this release yet)"
    return command


def register(app: typer.Typer) -> None:
    for name in PLANNED:
        app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                    add_help_option=False)(_placeholder(name))
