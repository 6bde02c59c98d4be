"""`lingctl pcache plan | status | upload`: thin wrappers over lingctl.pcache.

``plan`` lives in ``pcache_plan.py`` with its options; ``status`` and ``upload`` (the flash tier) are here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lingctl.commands.options import (
    DEFAULT_RETRIES,
    DURATION_FORMS,
    EndpointOpt,
    JsonOpt,
    PathStyleOpt,
    ProfileOpt,
    RegionOpt,
    RetriesOpt,
    VerifyMode,
    duration,
    s3_options,
)
from lingctl.commands.pcache_plan import plan
from lingctl.commands.pcache_render import render_status, upload_line
from lingctl.core.output import Output, to_jsonable

app = typer.Typer(
    help="Plan and run checkpoint writes spread across nodes, tiered to remote storage.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.command("plan")(plan)


@app.command("status")
def status(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory, or a cache directory holding checkpoints.")],
    remote: Annotated[
        str | None,
        typer.Option(
            "--remote",
            metavar="URL",
            help="Where PATH is uploaded (default: what each checkpoint's last upload recorded).",
        ),
    ] = None,
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    json: JsonOpt = False,
) -> None:
    """Show each checkpoint's state: incomplete, local-only, uploading, durable or upload-failed.

    Exit codes: 0 none failed, 1 a checkpoint's upload failed (run 'lingctl pcache upload' on it).
    """
    from lingctl.pcache import tier_status

    out = Output(json)
    rows = tier_status.status(path, remote, s3_options(endpoint_url, region, profile, path_style, retries))
    out.result(
        {"path": str(path), "checkpoints": to_jsonable(rows)}, lambda console: render_status(path, rows, console)
    )
    tier_status.raise_for_failed(rows)


@app.command("upload")
def upload(
    path: Annotated[Path, typer.Argument(help="One checkpoint directory (complete: it holds pcache.json).")],
    to: Annotated[
        str | None, typer.Option("--to", metavar="URL", help="Destination (default: the one its last upload recorded).")
    ] = None,
    verify: Annotated[
        VerifyMode, typer.Option("--verify", help="Check local files before and copies after: none, sampled or full.")
    ] = "full",
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=duration,
            metavar="DURATION",
            help=f"How long to wait for files other nodes upload ({DURATION_FORMS}).",
        ),
    ] = 60.0,
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    json: JsonOpt = False,
) -> None:
    """Upload a checkpoint, or finish an interrupted one, as its coordinator: files first, marker last.

    Files already at the destination are skipped, so running it again resumes.

    Exit codes: 0 durable, 3 no such directory, 4 a file failed verification, 5 failed copies or missing files.
    """
    from lingctl.pcache import tier

    s3 = s3_options(endpoint_url, region, profile, path_style, retries)
    result = tier.finish_upload(path, to, s3, verify=verify, timeout_s=timeout)
    Output(json).result(to_jsonable(result), upload_line(result))
