"""`lingctl train align`: one batch through two set-ups, every module compared forward and backward."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lingctl.commands.options import JsonOpt
from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.output import Output, to_jsonable
from lingctl.model.presets import PRESETS

SPEC_HELP = (
    "key=value,...: dtype=float32|bfloat16|float64, dispatch=naive|sorted|grouped, device=cpu|cuda, "
    "workers=N, mode=ddp|edit, balance=rank|batch, checkpoint=DIR, bug=KIND@MODULE"
)
DEFAULT_SHOW = 10


def align(
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help=f"Model shape: {', '.join(PRESETS)} (default tiny).")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", metavar="DIR", help="A Ling checkpoint directory: its shape and weights on both sides."
        ),
    ] = None,
    a: Annotated[str, typer.Option("--a", metavar="SPEC", help=f"Set-up a. {SPEC_HELP}.")] = "dtype=float32",
    b: Annotated[
        str | None, typer.Option("--b", metavar="SPEC", help="Set-up b, same keys (default dtype=bfloat16).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Sequences in the batch.")] = 4,
    seq_len: Annotated[int, typer.Option("--seq-len", min=1, help="Tokens per sequence.")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the token ids and, without --model, the weights.")] = 0,
    save: Annotated[
        Path | None,
        typer.Option(
            "--save", metavar="TRACE", help="Write set-up a's trace to this file (safetensors); alone, only records."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --save replace an existing file.")] = False,
    against: Annotated[
        Path | None,
        typer.Option(
            "--against",
            metavar="TRACE",
            help="Compare set-up a with a trace saved by --save (on another machine) instead of --b.",
        ),
    ] = None,
    same_routes: Annotated[
        bool,
        typer.Option(
            "--same-routes",
            help="Run the compared side on the reference's expert choices (b on a's; with --against, a on the "
            "trace's) and judge everything else on the same routes; the flips its own top-k would make are "
            "listed, passing when all are at near-ties. Use it for a dtype change; for a platform change, run "
            "with and without.",
        ),
    ] = False,
    modules: Annotated[
        str | None,
        typer.Option("--modules", metavar="REGEX", help="Trace only modules whose name matches (loss parts always)."),
    ] = None,
    show: Annotated[
        int | None,
        typer.Option(
            "--show",
            metavar="N",
            min=0,
            help=f"Print the first N entries in execution order (default: the first {DEFAULT_SHOW} failures, or the {DEFAULT_SHOW} largest differences).",
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Run one batch through set-ups a and b, compare every module's outputs, input gradients and parameter
    gradients (and the loss parts) and name the first module beyond tolerance, forward first.

    A flipped route at a near-tie (the reference's probabilities of the swapped experts within tolerance)
    is rounding, but every expert after it sees other tokens: --same-routes compares the rest on equal routes.

    Exit codes: 0 every entry within tolerance; 4 a module breaks it (verification failed); 2 bad options
    or a trace of another model or batch."""
    from lingctl.model.presets import preset as preset_config
    from lingctl.train.align.compare import AlignOptions, run_align
    from lingctl.train.align.setup import AlignJob, parse_setup

    out = Output(json)
    if preset is not None and model is not None:
        raise UsageError("--preset and --model both give the model shape; choose one")
    if b is not None and against is not None:
        raise UsageError("--b and --against both give set-up b; choose one")
    job = AlignJob(
        config=preset_config(preset or "tiny"),
        checkpoint=str(model) if model is not None else None,
        seed=seed,
        batch_size=batch_size,
        seq_len=seq_len,
        modules=modules,
    )
    only_record = save is not None and b is None and against is None
    opts = AlignOptions(
        job=job,
        a=parse_setup(a, side="a"),
        b=None if only_record or against is not None else parse_setup(b or "dtype=bfloat16", side="b"),
        against=against,
        save=save,
        force=force,
        same_routes=same_routes,
    )
    trace, report = run_align(opts)
    if report is None:
        done = {"event": "saved", "path": str(save), "entries": len(trace.entries), "setup": trace.meta["setup"]}
        out.result(done, f"{save}: {len(trace.entries)} entries of set-up a ({opts.a.describe()})")
        return
    out.result(to_jsonable(report), lambda console: _render(report, show, console))
    if not report.ok:
        # The report above ends with the verdict: the error line only counts, as babel verify's does.
        other = "set-up b" if against is None else str(against)
        raise VerificationError(
            f"{report.failed} of {report.compared} entries beyond tolerance between set-up a and {other}"
        )


def _side(meta: dict[str, Any]) -> str:
    s = meta["setup"]
    spec = f"dtype={s['dtype']},dispatch={s['dispatch']},device={s['device']}"
    if s["workers"] > 1:
        spec += f",workers={s['workers']},mode={s['mode']},balance={s['balance']}"
    spec += "".join(f",{k}={s[k]}" for k in ("checkpoint", "bug") if s.get(k))
    return f"{spec}  ({meta['host']}, {meta['device_name']}, torch {meta['torch']})"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _chosen(rows: list[Any], show: int | None) -> list[Any]:
    if show is not None:
        return rows[:show]
    failed = [r for r in rows if r.ok is False]
    if failed:
        return failed[:DEFAULT_SHOW]
    closest = sorted((r for r in rows if r.rel_diff is not None), key=lambda r: -r.rel_diff)[:DEFAULT_SHOW]
    return sorted(closest, key=lambda r: r.index)


def _render(report: Any, show: int | None, console: Any) -> None:
    lines = [f"a: {_side(report.a)}", f"b: {_side(report.b)}", f"tolerance: relative {report.tolerance:g}"]
    flips = report.route_flips
    if flips is not None:
        near = "unknown" if flips.near_ties is None else str(flips.near_ties)
        ties = f" ({near} at near-ties)" if flips.flipped else ""
        forced = report.routes_forced
        if forced is None:
            lines.append(f"routes: {flips.flipped}/{flips.slots} differ{ties}")
        else:
            ref = "b" if forced == "a" else "a"
            lines.append(
                f"routes: {forced} ran on {ref}'s; its own top-k would differ in {flips.flipped}/{flips.slots}{ties}"
            )
    rows = _chosen(report.rows, show)
    if show is None:
        shown = "the first failures" if report.failed else "the largest differences"
        lines.append(f"rows: {shown}, in execution order (--show N: the first N entries)")
    if rows:
        width = max(len(r.module) for r in rows)
        what = max(len("entry"), *(len(r.what) for r in rows))
        lines.append(f"{'#':>5}  phase  {'module':<{width}}  {'entry':<{what}}  abs diff  rel diff  tol       ok")
        for r in rows:
            ok = "ok" if r.ok else "-" if r.ok is None else "FAIL"
            note = f"  {r.note}" if r.note else ""
            lines.append(
                f"{r.index:>5}  {r.phase:<5}  {r.module:<{width}}  {r.what:<{what}}  "
                f"{_num(r.abs_diff):<8}  {_num(r.rel_diff):<8}  {r.tol:<8.0e}  {ok}{note}"
            )
    lines.append(
        f"{len(report.rows)} entries: {report.compared} compared, {report.failed} beyond tolerance, "
        f"{report.one_sided} on one side only"
    )
    for label, row in (("first forward", report.first_forward), ("first backward", report.first_backward)):
        lines.append(f"{label}: " + (f"#{row.index} {row.module} {row.what}" if row else "none"))
    lines.append(f"verdict: {report.verdict}")
    for line in lines:
        console.print(line, markup=False)
