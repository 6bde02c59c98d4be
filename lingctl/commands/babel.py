"""`lingctl babel ls | copy | sync | verify`: thin wrappers over lingctl.babel.

Keys and paths come from data (listings of trees other people wrote): every one shown in human output goes
through ``printable``, and every endpoint through ``redact_url``. JSON output keeps keys exact (JSON
escapes control characters itself).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from lingctl.commands.options import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_RETRIES,
    ContimeoutOpt,
    EndpointOpt,
    JsonOpt,
    PathStyleOpt,
    ProfileOpt,
    RegionOpt,
    RetriesOpt,
    TimeoutOpt,
    VerifyMode,
    s3_options,
)
from lingctl.core.errors import LingctlError, UsageError, VerificationError
from lingctl.core.names import printable
from lingctl.core.output import Output, to_jsonable
from lingctl.core.storage import S3Options, parse_url
from lingctl.core.storage.url import redact_url
from lingctl.core.units import format_size, parse_size

app = typer.Typer(
    help="Copy, sync and verify trees between local disks and S3-compatible stores.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

JobsOpt = Annotated[int, typer.Option("--jobs", "-j", metavar="N", min=1, help="Concurrent transfers and requests.")]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option("--include", metavar="GLOB", help="Only keys matching (repeatable; default: all keys)."),
]
ExcludeOpt = Annotated[
    list[str] | None, typer.Option("--exclude", metavar="GLOB", help="Skip keys matching (repeatable; default: none).")
]
SamplesOpt = Annotated[
    int, typer.Option("--samples", metavar="N", min=2, help="Sampled ranges (1 MiB each) per large object.")
]


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
    from lingctl.babel.listing import ListStats, UnreadableError, list_tree
    from lingctl.core.storage import open_store

    out = Output(json)
    s3 = s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout)
    parsed = parse_url(url)
    rows: list[dict[str, Any]] = []
    count = total = 0
    unreadable: list[tuple[str, LingctlError]] = []  # listed around, reported (and exit 1) after the listing

    def skipped(path: str, err: LingctlError) -> None:
        out.warn(f"cannot read {printable(err.message)}; listing the rest")
        unreadable.append((path, err))

    if recursive or summary:
        for batch in list_tree(parsed, s3, jobs=jobs, stats=ListStats(), on_unreadable=skipped):
            count += len(batch)
            total += sum(e.size for e in batch)
            if not summary:
                rows.extend({"key": e.key, "size": e.size, "mtime": e.mtime, "etag": e.etag} for e in batch)
        rows.sort(key=lambda r: r["key"])
    else:
        store = open_store(parsed, s3)
        store.check()
        for info in store.list("", recursive=False):
            rows.append(
                {
                    "key": info.key + ("/" if info.is_dir else ""),
                    "size": info.size,
                    "mtime": info.mtime if not info.is_dir else None,
                    "etag": info.etag,
                    "is_dir": info.is_dir,
                    "checksum": info.checksum,
                }
            )
            if not info.is_dir:
                count += 1
                total += info.size
    if summary:
        out.result(
            {"url": url, "objects": count, "bytes": total}, f"{count} objects, {format_size(total)} ({total} bytes)"
        )
    else:

        def human(console: Any) -> None:
            for r in rows:
                when = (
                    dt.datetime.fromtimestamp(r["mtime"]).strftime("%Y-%m-%d %H:%M:%S") if r.get("mtime") else " " * 19
                )
                console.print(f"{r['size']:>14} {when} {printable(r['key'])}", markup=False)

        out.result(rows, human)
    if unreadable:
        raise UnreadableError(unreadable)


SrcArg = Annotated[str, typer.Argument(help="Source: a path or s3://bucket/prefix, or one file or object.")]
DstArg = Annotated[
    str, typer.Argument(help="Destination: a path or s3://bucket/prefix (for one file: a directory, or the new name).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would change; change nothing.")]
ChecksumOpt = Annotated[bool, typer.Option("--checksum", "-c", help="Compare CRC64NVME, not size + mtime.")]
PartSizeOpt = Annotated[
    str | None, typer.Option("--part-size", metavar="SIZE", help="Multipart part size (default: adapts, >= 8MiB).")
]
VerifyOpt = Annotated[
    VerifyMode, typer.Option("--verify", help="After each copy: none, sampled (CRCs of sampled ranges) or full.")
]
ShardOpt = Annotated[
    str | None,
    typer.Option("--shard", metavar="I/N", help="Take only shard I of N of the key space (default: all of it)."),
]
CommitLastOpt = Annotated[
    str | None,
    typer.Option(
        "--commit-last",
        metavar="NAME",
        help="Copy NAME only after everything else is copied and verified (default: no such ordering).",
    ),
]
StateDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--state-dir", metavar="DIR", help="Where the resumable journal lives (default: ~/.cache/lingctl/babel/...)."
    ),
]
StatsOpt = Annotated[
    str, typer.Option("--stats", metavar="DURATION", help="Off a terminal: a stats line on stderr this often (0: off).")
]
ProgressOpt = Annotated[
    bool, typer.Option("--progress", "-P", help="Show the live progress display, even off a terminal.")
]
BwlimitOpt = Annotated[
    str, typer.Option("--bwlimit", metavar="RATE", help="Limit the transfer rate, e.g. 10M = 10 MiB/s (0: off).")
]


@app.command("copy")
def copy(
    src: SrcArg,
    dst: DstArg,
    dry_run: DryRunOpt = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    checksum: ChecksumOpt = False,
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
    _transfer(
        src,
        dst,
        delete=False,
        max_delete=None,
        dry_run=dry_run,
        include=include,
        exclude=exclude,
        checksum=checksum,
        jobs=jobs,
        part_size=part_size,
        verify=verify,
        samples=samples,
        shard=shard,
        commit_last=commit_last,
        state_dir=state_dir,
        stats=stats,
        progress=progress,
        bwlimit=bwlimit,
        s3=s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout),
        json=json,
    )


@app.command("sync")
def sync(
    src: SrcArg,
    dst: DstArg,
    dry_run: DryRunOpt = False,
    max_delete: Annotated[
        int | None,
        typer.Option(
            "--max-delete", metavar="N", help="Delete nothing if more than N would be deleted (default: no limit)."
        ),
    ] = None,
    delete: Annotated[
        bool, typer.Option("--delete", hidden=True, help="Accepted for old scripts: sync always deletes.")
    ] = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    checksum: ChecksumOpt = False,
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
    del delete  # sync deletes anyway; the flag predates 'babel copy'
    _transfer(
        src,
        dst,
        delete=True,
        max_delete=max_delete,
        dry_run=dry_run,
        include=include,
        exclude=exclude,
        checksum=checksum,
        jobs=jobs,
        part_size=part_size,
        verify=verify,
        samples=samples,
        shard=shard,
        commit_last=commit_last,
        state_dir=state_dir,
        stats=stats,
        progress=progress,
        bwlimit=bwlimit,
        s3=s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout),
        json=json,
    )


def _transfer(
    src: str,
    dst: str,
    *,
    delete: bool,
    max_delete: int | None,
    dry_run: bool,
    include: list[str] | None,
    exclude: list[str] | None,
    checksum: bool,
    jobs: int,
    part_size: str | None,
    verify: str,
    samples: int,
    shard: str | None,
    commit_last: str | None,
    state_dir: Path | None,
    stats: str,
    progress: bool,
    bwlimit: str,
    s3: S3Options,
    json: bool,
) -> None:
    from lingctl.babel.bwlimit import TokenBucket, parse_rate
    from lingctl.babel.filters import parse_shard
    from lingctl.babel.meter import Meter
    from lingctl.babel.overlap import check_no_overlap
    from lingctl.babel.preflight import prepare
    from lingctl.babel.single import plan
    from lingctl.babel.sync import Syncer, SyncOptions
    from lingctl.commands.babel_render import progress_text, stats_line
    from lingctl.core.units import parse_duration

    out = Output(json)
    try:
        interval = parse_duration(stats)
    except ValueError as err:
        raise UsageError(str(err), hint="write e.g. 1m, 30s, 500ms, 1h30m, or 0 for off") from None
    rate = parse_rate(bwlimit)
    opts = SyncOptions(
        dry_run=dry_run,
        delete=delete,
        max_delete=max_delete,
        include=include or [],
        exclude=exclude or [],
        checksum=checksum,
        jobs=jobs,
        part_size=parse_size(part_size) if part_size else None,
        verify=verify,
        samples=samples,
        shard=parse_shard(shard),
        commit_last=commit_last,
        state_dir=state_dir,
        limiter=TokenBucket(rate) if rate else None,
    )
    opts.validate()
    p = plan(src, dst, s3)  # one HEAD for an S3 source: is it a single object?
    if p.objects is None:
        check_no_overlap(p.src, p.dst)
    else:
        opts.objects, opts.delete = p.objects, False  # one object: nothing else of DST is ours to delete
    opts.state_dir = prepare(p.src, p.dst, state_dir, dry_run=dry_run)
    meter = Meter()
    live = progress or out.progress_enabled
    # Off a terminal nothing is drawn, so a log gets a stats line every --stats interval instead.
    lines = interval if not live and not out.stderr_is_terminal else 0.0
    with (
        out.progress("syncing", total=0, unit="bytes", binary_units=True, force=progress) as bar,
        out.stats_lines(lines, lambda: stats_line(meter.totals())),
    ):

        def on_progress(kind: str, n: int) -> None:
            meter(kind, n)
            if kind == "queued":
                bar.update(total=meter.queued_bytes)
            elif kind == "bytes":
                bar.advance(n)
            elif kind in ("copied", "checked", "listed"):
                bar.update(description=progress_text(meter.totals()))

        result = Syncer(p.src, p.dst, s3, opts, on_progress).run()
    _report(out, result)


def _report(out: Output, r: Any) -> None:
    r.source, r.destination = redact_url(r.source), redact_url(r.destination)

    def human(console: Any) -> None:
        if r.dry_run:
            for key in r.would_copy:
                console.print(f"would copy  {printable(key)}", markup=False)
            for key in r.would_delete:
                console.print(f"would delete {printable(key)}", markup=False)
        for f in r.failed:
            console.print(f"FAILED {printable(f['key'])}: {printable(redact_url(f['error']))}", markup=False)
        verb = "would copy" if r.dry_run else "copied"
        n, size = (len(r.would_copy), r.would_copy_bytes) if r.dry_run else (r.copied, r.copied_bytes)
        console.print(
            f"{verb} {n} objects ({format_size(size)}), {r.skipped} up to date, "
            f"{r.deleted if not r.dry_run else len(r.would_delete)} "
            f"{'deleted' if not r.dry_run else 'to delete'}, {len(r.failed)} failed; "
            f"listed {r.listed_source} + {r.listed_destination} objects in {r.list_requests} requests; "
            f"{r.retries} retries; {r.seconds:.1f} s",
            markup=False,
        )
        if r.deletes_skipped:
            console.print(r.deletes_skipped, markup=False)

    out.result(to_jsonable(r), human)
    failure = r.failure()
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

    out = Output(json)
    src_url, dst_url = parse_url(src), parse_url(dst)
    # Comparing a tree with itself would "verify" anything; one inside the other is only a comparison.
    check_no_overlap(src_url, dst_url, allow_nested=True)
    s3 = s3_options(endpoint_url, region, profile, path_style, retries, timeout=timeout, contimeout=contimeout)
    result = run_verify(
        src_url, dst_url, s3, mode=mode, samples=samples, jobs=jobs, key_filter=KeyFilter(include or [], exclude or [])
    )
    result.source, result.destination = redact_url(result.source), redact_url(result.destination)

    def human(console: Any) -> None:
        for d in result.differences:
            sides = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items() if k not in ("key", "problem"))
            console.print(f"DIFFERS {printable(d['key'])}: {d['problem']} ({sides})", markup=False)
        console.print(
            f"{result.checked} objects compared ({result.mode}), {result.matched} match, "
            f"{len(result.differences)} differ; {result.seconds:.1f} s",
            markup=False,
        )

    out.result({**to_jsonable(result), "ok": result.ok}, human)
    if not result.ok:
        raise VerificationError(
            f"{len(result.differences)} difference(s) between {printable(src)} and {printable(dst)}"
        )
