"""`lingctl train align`: one batch through two set-ups, every module compared forward and backward."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import JsonOpt
from lingctl.commands.train_render import ALIGN_ROWS, render_align
from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.output import Output, to_jsonable
from lingctl.model.presets import PRESETS

SPEC_HELP = (
    "key=value,...: dtype=float32|bfloat16|float64, dispatch=naive|sorted|grouped, device=cpu|cuda, "
    "workers=N, mode=ddp|edit, balance=rank|batch, checkpoint=DIR, bug=KIND@MODULE"
)

PresetOpt = Annotated[
    str | None, typer.Option("--preset", "-p", help=f"Model shape: {', '.join(PRESETS)} (default tiny).")
]
ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", metavar="DIR", help="A Ling checkpoint directory: its shape and weights on both sides."),
]
SetupAOpt = Annotated[str, typer.Option("--a", metavar="SPEC", help=f"Set-up a. {SPEC_HELP}.")]
SetupBOpt = Annotated[
    str | None, typer.Option("--b", metavar="SPEC", help="Set-up b, same keys (default dtype=bfloat16).")
]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", min=1, help="Sequences in the batch.")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", min=1, help="Tokens per sequence.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seeds the token ids and, without --model, the weights.")]
SaveOpt = Annotated[
    Path | None,
    typer.Option(
        "--save", metavar="TRACE", help="Write set-up a's trace to this file (safetensors); alone, only records."
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Let --save replace an existing file.")]
AgainstOpt = Annotated[
    Path | None,
    typer.Option(
        "--against",
        metavar="TRACE",
        help="Compare set-up a with a trace saved by --save (on another machine) instead of --b.",
    ),
]
SameRoutesOpt = Annotated[
    bool,
    typer.Option(
        "--same-routes",
        help="Run the compared side on the reference's expert choices (b on a's; with --against, a on the "
        "trace's) and judge everything else on the same routes; the flips its own top-k would make are "
        "listed, passing when all are at near-ties. Use it for a dtype change; for a platform change, run "
        "with and without.",
    ),
]
ModulesOpt = Annotated[
    str | None,
    typer.Option("--modules", metavar="REGEX", help="Trace only modules whose name matches (loss parts always)."),
]
ShowOpt = Annotated[
    int | None,
    typer.Option(
        "--show",
        metavar="N",
        min=0,
        help=f"Print the first N entries in execution order (default: the first {ALIGN_ROWS} failures, or the "
        f"{ALIGN_ROWS} largest differences).",
    ),
]


def align(
    preset: PresetOpt = None,
    model: ModelOpt = None,
    a: SetupAOpt = "dtype=float32",
    b: SetupBOpt = None,
    batch_size: BatchSizeOpt = 4,
    seq_len: SeqLenOpt = 32,
    seed: SeedOpt = 0,
    save: SaveOpt = None,
    force: ForceOpt = False,
    against: AgainstOpt = None,
    same_routes: SameRoutesOpt = False,
    modules: ModulesOpt = None,
    show: ShowOpt = None,
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
    out.result(to_jsonable(report), lambda console: render_align(report, show, console))
    if not report.ok:
        # The report above ends with the verdict: the error line only counts, as babel verify's does.
        other = "set-up b" if against is None else str(against)
        raise VerificationError(
            f"{report.failed} of {report.compared} entries beyond tolerance between set-up a and {other}"
        )
