"""`lingctl timer attach`: a live view of one process, a thin wrapper over lingctl.timer.attach."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from lingctl.commands.options import DURATION_FORMS, JsonOpt, at_least, duration
from lingctl.core.errors import NotFoundError
from lingctl.core.output import Output

if TYPE_CHECKING:
    from lingctl.timer.attach import Attacher


def attach(
    pid: Annotated[int, typer.Option("--pid", "-p", metavar="PID", help="The process to look at.")],
    once: Annotated[bool, typer.Option("--once", help="One snapshot, then exit.")] = False,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            "-i",
            parser=duration,
            metavar="DURATION",
            help=f"Time between refreshes, at least 100ms ({DURATION_FORMS}).",
        ),
    ] = 2.0,
    stacks: Annotated[
        bool,
        typer.Option(
            "--stacks/--no-stacks",
            help="Include the Python stacks of every thread. Off by default, as a live view's stacks cost every "
            "refresh a signal to the process and a wait for its dump (py-spy for an untraced one).",
        ),
    ] = False,
    steps: Annotated[int, typer.Option("--steps", metavar="N", min=1, help="Steps the breakdown averages over.")] = 20,
    json: JsonOpt = False,
) -> None:
    """Watch one process: step time breakdown, what it is inside now, CPU/memory/GPU, stacks.

    Refreshes every --interval until Ctrl-C (one JSON line per refresh with --json); --once prints one snapshot.
    """
    from lingctl.commands.timer_render import render
    from lingctl.timer.attach import Attacher

    at_least("--interval", interval, 0.1)
    out = Output(json)
    attacher = Attacher(pid, window_steps=steps)
    try:
        time.sleep(0.1)  # CPU % needs an interval
        if once:
            snap = attacher.snapshot(stacks=stacks)
            out.result(snap, render(snap))
            return
        _watch(attacher, out, interval=interval, stacks=stacks, live=not json and out.console.is_terminal)
    finally:
        attacher.close()


def _watch(attacher: Attacher, out: Output, *, interval: float, stacks: bool, live: bool) -> None:
    """Refresh every ``interval`` until Ctrl-C or the process exits: one view redrawn in place on a terminal
    (``live``), else one line (or JSON object) per refresh."""
    from lingctl.commands.timer_render import render, status_line

    view = None
    if live:
        from rich.live import Live
        from rich.text import Text

        view = Live(console=out.console, auto_refresh=False)
        view.start()
    try:
        while True:
            try:
                snap = attacher.snapshot(stacks=stacks)
            except NotFoundError:
                out.info(f"process {attacher.pid} exited")
                return
            if view is not None:
                view.update(Text(render(snap), overflow="fold"), refresh=True)
            else:
                out.record(snap, status_line(snap))
            time.sleep(interval)
    except KeyboardInterrupt:
        return
    finally:
        if view is not None:
            view.stop()
