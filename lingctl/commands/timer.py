"""`lingctl timer run | attach | diagnose | export`: thin wrappers over lingctl.timer."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lingctl.commands.options import DURATION_FORMS, STDOUT, JsonOpt, duration
from lingctl.commands.timer_attach import attach
from lingctl.core.errors import UsageError
from lingctl.core.output import Output

app = typer.Typer(
    help="Trace training processes cheaply: step breakdown, live attach, hang and straggler "
    "diagnosis, timeline export.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


# Options end at CMD's first word, so `timer run python train.py -v` passes -v to CMD, not to lingctl.
@app.command(
    "run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}
)
def run(
    ctx: typer.Context,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", metavar="DIR", help="Trace directory (default: timer-TIMESTAMP).")
    ] = None,
    trace: Annotated[
        str | None,
        typer.Option(
            "--trace",
            metavar="SPEC",
            help="What to trace: comma list of collectives, p2p, optimizer, data, forward, "
            "backward, copy; '-name' removes one (default: all).",
        ),
    ] = None,
) -> None:
    """Run CMD (after --) with every Python process it starts traced; exits with CMD's exit code."""
    from lingctl.timer.launch import run_traced
    from lingctl.timer.tracer import parse_targets

    if not ctx.args:
        raise UsageError("no command to run", hint="lingctl timer run --out DIR -- python train.py ...")
    if out is not None and str(out) == STDOUT:
        raise UsageError(
            "--out is a trace directory; it cannot be standard output ('-')",
            hint="lingctl timer run --out DIR -- CMD ...",
        )
    try:
        parse_targets(trace)
    except ValueError as err:
        raise UsageError(f"--trace {trace!r}: {err}") from None
    out = out if out is not None else Path(f"timer-{time.strftime('%Y%m%d-%H%M%S')}")
    raise typer.Exit(run_traced(list(ctx.args), out=out, targets=trace))


app.command("attach")(attach)


@app.command("diagnose")
def diagnose(
    trace_dir: Annotated[Path | None, typer.Argument(metavar="DIR", help="Trace directory of the job.")] = None,
    pids: Annotated[
        str | None, typer.Option("--pids", metavar="PID,...", help="Traced processes of the job (instead of DIR).")
    ] = None,
    hang_after: Annotated[
        float,
        typer.Option(
            "--hang-after",
            parser=duration,
            metavar="DURATION",
            help=f"Time in one collective that counts as a hang ({DURATION_FORMS}).",
        ),
    ] = 5.0,
    stacks: Annotated[bool, typer.Option("--stacks/--no-stacks", help="Ask stuck ranks for their stacks.")] = True,
    json: JsonOpt = False,
) -> None:
    """Find a hang or a straggler across all ranks of a job.

    Hang: who never arrived at which collective, and where they are. Straggler: who arrives last, and whether
    data, compute or communication makes it slow. Exit 0 when the analysis ran (the verdict is in the output),
    3 when there are no traces.
    """
    from lingctl.commands.timer_render import print_diagnosis
    from lingctl.timer.diagnose import diagnose as run_diagnosis

    if (trace_dir is None) == (pids is None):
        raise UsageError("give a trace directory or --pids, not both", hint="lingctl timer diagnose timer-DIR")
    pid_list = None
    if pids is not None:
        try:
            pid_list = [int(p) for p in pids.split(",") if p.strip()]
        except ValueError:
            raise UsageError(f"--pids {pids!r}: expected comma-separated process ids") from None
        if not pid_list:
            raise UsageError("--pids is empty")
    d = run_diagnosis(trace_dir, pid_list, hang_after_s=hang_after, stacks=stacks)
    Output(json).result(d.to_json(), lambda console: print_diagnosis(d, console))


@app.command("export")
def export(
    trace_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Trace directory of the job.")],
    dest: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            metavar="FILE",
            help="Chrome trace / Perfetto JSON file to write; '-': standard output "
            "(the summary then goes to stderr).  [required]",
        ),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", hidden=True, help="Old name of --out.")] = None,
    json: JsonOpt = False,
) -> None:
    """All ranks on one timeline in a Chrome trace (open it in ui.perfetto.dev or chrome://tracing)."""
    from lingctl.timer.export import export_chrome

    if dest is not None and output is not None:
        raise UsageError("--out and --output are the same option; give it once")
    dest = dest if dest is not None else output
    if dest is None:
        raise UsageError("missing option '--out'", hint="lingctl timer export DIR --out trace.json")
    if str(dest) != STDOUT:
        n = export_chrome(trace_dir, dest)
        Output(json).result({"path": dest, "events": n}, f"wrote {n} events to {dest}")
        return
    with tempfile.TemporaryDirectory(prefix="lingctl-export-") as scratch:
        tmp = Path(scratch) / "trace.json"
        n = export_chrome(trace_dir, tmp)
        with open(tmp, "rb") as f:
            shutil.copyfileobj(f, _binary_stdout())
        sys.stdout.flush()
    # stdout holds the trace; the summary must not be mixed into it.
    Output(json, stdout=sys.stderr).result({"path": "stdout", "events": n}, f"wrote {n} events to stdout")


def _binary_stdout() -> Any:
    stream = getattr(sys.stdout, "buffer", None)
    if stream is None:  # a text-only stdout (a test's capture)
        raise UsageError("standard output does not take bytes here; write to a file with --out FILE")
    sys.stdout.flush()
    return stream
