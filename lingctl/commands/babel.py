"""`lingctl babel ls | copy | sync | verify`: thin wrappers over lingctl.babel; output is written by
``babel_render``.

Keys and paths come from data: one quoted in an error goes through ``printable``, and an endpoint through
``redact_url``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import typer

from lingctl.commands.options import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_RETRIES,
    BwlimitOpt,
    ChecksumOpt,
    CommitLastOpt,
    ContimeoutOpt,
    DeleteOpt,
    DryRunOpt,
    DstArg,
    EndpointOpt,
    ExcludeOpt,
    FilesFromOpt,
    IgnoreExistingOpt,
    IncludeOpt,
    JobsOpt,
    JsonOpt,
    MaxDeleteOpt,
    PartSizeOpt,
    PathStyleOpt,
    ProfileOpt,
    ProgressOpt,
    RegionOpt,
    RetriesOpt,
    SamplesOpt,
    ShardOpt,
    SizeOnlyOpt,
    SrcArg,
    StateDirOpt,
    StatsOpt,
    TimeoutOpt,
    VerifyOpt,
    s3_options,
)
from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.names import printable
from lingctl.core.output import Output
from lingctl.core.storage import parse_url
from lingctl.core.storage.url import redact_url

if TYPE_CHECKING:
    from lingctl.babel.run import TransferConfig

app = typer.Typer(
    help="Copy, sync and verify trees between local disks and S3-compatible stores.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.command("ls")
def ls(
    url: Annotated[str, typer.Argument(help="A path or s3://bucket/prefix.")],
    recursive: Annotated[bool, typer.Option("--recursive", "-R", help="Everything below, not one level.")] = False,
    summary: Annotated[bool, typer.Option("--summary", help="Only the count and total size.")] = False,
    jobs: JobsOpt = 16,
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    timeout: TimeoutOpt = DEFAULT_READ_TIMEOUT,
    contimeout: ContimeoutOpt = DEFAULT_CONNECT_TIMEOUT,
    json: JsonOpt = False,
) -> None:
    """List objects (key, size, modification time, etag) or, with --summary, their count and total size."""
    from lingctl.babel.listing import UnreadableError, list_entries
    from lingctl.commands.babel_render import show_entries

    out = Output(json)
    s3 = s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout)
    found = list_entries(
        parse_url(url),
        s3,
        recursive=recursive,
        count_only=summary,
        jobs=jobs,
        # Listed around, and reported (exit 1) after the listing.
        on_unreadable=lambda _path, err: out.warn(f"cannot read {printable(err.message)}; listing the rest"),
    )
    show_entries(out, url, found, recursive=recursive or summary, summary=summary)
    if found.unreadable:
        raise UnreadableError(found.unreadable)


@app.command("copy")
def copy(
    src: SrcArg,
    dst: DstArg,
    dry_run: DryRunOpt = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    checksum: ChecksumOpt = False,
    size_only: SizeOnlyOpt = False,
    ignore_existing: IgnoreExistingOpt = False,
    files_from: FilesFromOpt = None,
    jobs: JobsOpt = 16,
    part_size: PartSizeOpt = None,
    verify: VerifyOpt = "sampled",
    samples: SamplesOpt = 64,
    shard: ShardOpt = None,
    commit_last: CommitLastOpt = None,
    state_dir: StateDirOpt = None,
    stats: StatsOpt = "1m",
    progress: ProgressOpt = False,
    bwlimit: BwlimitOpt = "0",
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    timeout: TimeoutOpt = DEFAULT_READ_TIMEOUT,
    contimeout: ContimeoutOpt = DEFAULT_CONNECT_TIMEOUT,
    json: JsonOpt = False,
) -> None:
    """Copy what is missing or different from SRC to DST; never deletes. Re-running resumes.

    SRC may be one file (or s3:// object): it goes into DST when DST ends in '/' or is an existing
    directory or prefix, else it is copied to the name DST. Exit codes: docs/babel.md.
    """
    from lingctl.babel.run import TransferConfig

    config = TransferConfig(
        src=src,
        dst=dst,
        s3=s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout),
        dry_run=dry_run,
        include=include or [],
        exclude=exclude or [],
        checksum=checksum,
        size_only=size_only,
        ignore_existing=ignore_existing,
        files_from=files_from,
        jobs=jobs,
        part_size=part_size,
        verify=verify,
        samples=samples,
        shard=shard,
        commit_last=commit_last,
        state_dir=state_dir,
        bwlimit=bwlimit,
    )
    _transfer(config, stats=stats, progress=progress, json=json)


@app.command("sync")
def sync(
    src: SrcArg,
    dst: DstArg,
    dry_run: DryRunOpt = False,
    max_delete: MaxDeleteOpt = None,
    delete: DeleteOpt = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    checksum: ChecksumOpt = False,
    size_only: SizeOnlyOpt = False,
    ignore_existing: IgnoreExistingOpt = False,
    files_from: FilesFromOpt = None,
    jobs: JobsOpt = 16,
    part_size: PartSizeOpt = None,
    verify: VerifyOpt = "sampled",
    samples: SamplesOpt = 64,
    shard: ShardOpt = None,
    commit_last: CommitLastOpt = None,
    state_dir: StateDirOpt = None,
    stats: StatsOpt = "1m",
    progress: ProgressOpt = False,
    bwlimit: BwlimitOpt = "0",
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    timeout: TimeoutOpt = DEFAULT_READ_TIMEOUT,
    contimeout: ContimeoutOpt = DEFAULT_CONNECT_TIMEOUT,
    json: JsonOpt = False,
) -> None:
    """Make DST identical to SRC: copy what is missing or different, then delete from DST what SRC lacks
    (within --include/--exclude; never after a failed copy or an unreadable listing). Re-running resumes.

    A single-file SRC is copied as by 'babel copy' (nothing is deleted). Exit codes: docs/babel.md.
    """
    from lingctl.babel.run import TransferConfig

    del delete  # sync deletes anyway; the flag predates 'babel copy'
    config = TransferConfig(
        src=src,
        dst=dst,
        s3=s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout),
        delete=True,
        max_delete=max_delete,
        dry_run=dry_run,
        include=include or [],
        exclude=exclude or [],
        checksum=checksum,
        size_only=size_only,
        ignore_existing=ignore_existing,
        files_from=files_from,
        jobs=jobs,
        part_size=part_size,
        verify=verify,
        samples=samples,
        shard=shard,
        commit_last=commit_last,
        state_dir=state_dir,
        bwlimit=bwlimit,
    )
    _transfer(config, stats=stats, progress=progress, json=json)


def _transfer(config: TransferConfig, *, stats: str, progress: bool, json: bool) -> None:
    """Run a copy or sync, showing its progress while it copies, then its result."""
    from lingctl.babel.run import plan_transfer
    from lingctl.commands.babel_render import live_progress, show_sync
    from lingctl.core.units import parse_duration

    out = Output(json)
    try:
        every = parse_duration(stats)
    except ValueError as err:
        raise UsageError(str(err), hint="write e.g. 1m, 30s, 500ms, 1h30m, or 0 for off") from None
    planned = plan_transfer(config)
    with live_progress(out, stats_every=every, force=progress) as on_progress:
        result = planned.run(on_progress)
    show_sync(out, result)
    failure = result.failure()
    if failure is not None:
        failure.message = printable(redact_url(failure.message))  # it quotes a key and an error from data
        raise failure


@app.command("verify")
def verify(
    src: Annotated[str, typer.Argument(help="Source: a path or s3://bucket/prefix.")],
    dst: Annotated[str, typer.Argument(help="Destination: a path or s3://bucket/prefix.")],
    mode: Annotated[
        Literal["meta", "sampled", "full"],
        typer.Option("--mode", help="meta (sizes), sampled (CRCs of sampled ranges) or full."),
    ] = "sampled",
    samples: SamplesOpt = 64,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    jobs: JobsOpt = 16,
    endpoint_url: EndpointOpt = None,
    region: RegionOpt = None,
    profile: ProfileOpt = None,
    path_style: PathStyleOpt = None,
    retries: RetriesOpt = DEFAULT_RETRIES,
    timeout: TimeoutOpt = DEFAULT_READ_TIMEOUT,
    contimeout: ContimeoutOpt = DEFAULT_CONNECT_TIMEOUT,
    json: JsonOpt = False,
) -> None:
    """Compare SRC and DST object by object; exit 4 and name every difference with both sides' figures."""
    from lingctl.babel.filters import KeyFilter
    from lingctl.babel.overlap import check_no_overlap
    from lingctl.babel.verify import verify as run_verify
    from lingctl.commands.babel_render import show_verify

    out = Output(json)
    src_url, dst_url = parse_url(src), parse_url(dst)
    # Comparing a tree with itself would "verify" anything; one inside the other is only a comparison.
    check_no_overlap(src_url, dst_url, allow_nested=True)
    s3 = s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout)
    result = run_verify(
        src_url, dst_url, s3, mode=mode, samples=samples, jobs=jobs, key_filter=KeyFilter(include or [], exclude or [])
    )
    show_verify(out, result)
    if not result.ok:
        raise VerificationError(
            f"{len(result.differences)} difference(s) between {printable(src)} and {printable(dst)}"
        )
