"""`lingctl train sweep` and `lingctl train fit`: a hyper-parameter sweep over compute budgets, and the scaling
laws of the best learning rate and batch size fitted from it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import JsonOpt
from lingctl.core.errors import UsageError
from lingctl.core.output import Output, to_jsonable


def sweep(
    spec: Annotated[
        Path | None,
        typer.Argument(metavar="[SPEC.toml]", help="A TOML file with a [sweep] table (default: the built-in spec)."),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", "-o", metavar="DIR", help="The sweep directory (new, or this spec's).")
    ] = Path("sweep"),
    parallel: Annotated[
        int | None, typer.Option("--parallel", min=1, metavar="N", help="Points run at once [default: the spec's, 1].")
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            metavar="I/N",
            help="Run every N-th point from the I-th (0-based): one shard per machine sharing the sweep directory.",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Run every point of a sweep: each an ordinary `lingctl train` run under DIR/runs/. Run it again to continue:
    finished points are kept, an interrupted one resumes from its checkpoint. Then `lingctl train fit DIR`."""
    from lingctl.train.sweep.runner import load_spec_file, run_sweep

    o = Output(json)
    s = load_spec_file(spec)
    if parallel is not None:
        s.parallel = parallel

    def shown(r: dict) -> None:
        o.info(f"{r['id']}: eval loss {r['eval_loss']:.4f} after {r['steps']} steps ({r['compute']:.3g} FLOPs)")

    result = run_sweep(out, s, on_point=shown, shard=_shard(shard))
    o.result(
        to_jsonable(result),
        f"{result.ran} point(s) run, {result.finished_before} finished before, {len(result.failed)} failed, of "
        f"{result.points}; attention adds {100 * result.attention_share:.0f}% to 6 x N x D; next: lingctl train fit {out}",
    )
    if result.failed:
        raise typer.Exit(1)


def _shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise UsageError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def fit(
    directory: Annotated[Path, typer.Argument(metavar="SWEEP", help="A sweep directory of lingctl train sweep.")],
    tolerance: Annotated[
        float, typer.Option("--tolerance", min=0.0, help="Near-optimal: loss within this fraction of a budget's best.")
    ] = 0.0025,
    json: JsonOpt = False,
) -> None:
    """Fit lr_opt(C) and B_opt(C) and loss against compute from a sweep's results; writes SWEEP/fit.json and
    PNG plots beside it."""
    from lingctl.train.sweep.fit_run import fit_directory

    o = Output(json)
    report = fit_directory(directory, tolerance=tolerance)
    o.result(report.fit, "\n".join(report.lines))
