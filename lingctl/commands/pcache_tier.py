"""`lingctl pcache status | upload`: thin wrappers over the flash tier (lingctl.pcache.tier)."""

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
from lingctl.commands.pcache_render import render_status
from lingctl.core.errors import LingctlError, UsageError
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_size


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
    failed = [r for r in rows if r.state == "upload-failed"]
    if failed:
        first = failed[0]
        why = f": {first.problems[0]}" if first.problems else ""
        raise LingctlError(
            f"{len(failed)} checkpoint upload(s) failed; first: {first.name}{why}",
            hint=f"lingctl pcache upload {first.local_dir} --to {first.remote or 'URL'}",
        )


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

    out = Output(json)
    remote = to or tier.recorded_remote(path)
    if remote is None:
        raise UsageError(f"no destination for {path}: it was never uploaded", hint="give --to URL")
    r = tier.upload(
        path,
        remote,
        s3_options(endpoint_url, region, profile, path_style, retries),
        rank=None,
        finalize=True,
        verify=verify,
        timeout_s=timeout,
    )
    out.result(
        to_jsonable(r),
        f"{r.local_dir} -> {r.remote}: durable; copied {r.copied} file(s) "
        f"({format_size(r.copied_bytes)}), {r.skipped} already there; {r.seconds:.1f} s",
    )
