"""Options shared by several commands, defined once (as huggingface_hub's CLI does)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import typer

from lingctl.core.errors import UsageError
from lingctl.core.storage import S3Options
from lingctl.core.storage.s3.client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT
from lingctl.core.storage.url import check_endpoint_url
from lingctl.core.units import parse_duration

log = logging.getLogger("lingctl.commands")

# One default for every command that talks to a store. Five attempts, the first included: a request that
# fails five times in a row (with backoff between) is not a transient fault, and five is already the floor
# that babel's listings use for their many pages (lingctl.core.storage.s3.listing).
DEFAULT_RETRIES = 5

# Fixed sets of values: Typer checks them (a bad one is a usage error, exit 2) and --help lists them.
VerifyMode = Literal["none", "sampled", "full"]

# Where a command writes one file, this name means standard output.
STDOUT = "-"

# Every option that takes a length of time reads it the one way, rclone's: 90, 500ms, 30s, 5m, 1h30m, 2d.
DURATION_FORMS = "a number of seconds, or 500ms, 30s, 5m, 1h"


def duration(text: str | float) -> float:
    """Seconds, for ``typer.Option(parser=duration, metavar="DURATION")``. Click also passes an option's
    default through the parser, so a number (the default's seconds) is taken as it is."""
    if isinstance(text, int | float):
        return float(text)
    try:
        return parse_duration(text)
    except ValueError as err:
        raise typer.BadParameter(f"{err} (write {DURATION_FORMS})") from None


def at_least(option: str, seconds: float | None, minimum: float) -> None:
    """A duration option below its floor is a usage error (a parser option cannot carry Typer's ``min``)."""
    if seconds is not None and seconds < minimum:
        raise UsageError(f"{option} must be at least {minimum:g} s, got {seconds:g} s")


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout (JSON).")]

EndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--endpoint-url",
        metavar="URL",
        help="S3 endpoint, e.g. http://127.0.0.1:9000 (default: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL).",
    ),
]
RegionOpt = Annotated[
    str | None,
    typer.Option(
        "--region",
        metavar="REGION",
        help="S3 region (default: AWS_REGION / AWS_DEFAULT_REGION / profile, else us-east-1).",
    ),
]
ProfileOpt = Annotated[
    str | None, typer.Option("--profile", metavar="PROFILE", help="AWS profile (default: AWS_PROFILE).")
]
PathStyleOpt = Annotated[
    bool | None,
    typer.Option(
        "--path-style/--virtual-host",
        help="S3 addressing (default: path style with a custom endpoint, virtual-host on AWS).",
    ),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        metavar="DURATION",
        parser=duration,
        help="S3 idle timeout: the longest wait for any byte of an answer; an answer averaging under 1 KiB/s "
        f"over this long is also cut (rclone's --timeout; {DURATION_FORMS}).",
    ),
]
ContimeoutOpt = Annotated[
    float,
    typer.Option(
        "--contimeout",
        metavar="DURATION",
        parser=duration,
        help=f"S3 connect timeout (rclone's --contimeout; {DURATION_FORMS}).",
    ),
]
RetriesOpt = Annotated[
    int,
    typer.Option(
        "--retries", metavar="N", min=1, help="Attempts per S3 request, the first included, before giving up."
    ),
]


def s3_options(
    endpoint_url: str | None,
    region: str | None,
    profile: str | None,
    path_style: bool | None,
    retries: int = DEFAULT_RETRIES,
    *,
    timeout: float = DEFAULT_READ_TIMEOUT,
    contimeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> S3Options:
    """The S3 settings of a command. The endpoint (flag, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) is
    checked here, so a malformed one is a one-line usage error before anything runs, and it is passed on
    without user info: nothing later (errors, reports, JSON) can show a password typed into it.
    ``timeout``/``contimeout`` (seconds) are --timeout and --contimeout."""
    raw = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    endpoint = check_endpoint_url(raw) if raw else None
    if raw and "@" in urlsplit(raw).netloc:
        log.warning(
            "ignoring the user:password in the endpoint URL: S3 requests are signed with the AWS "
            "credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE), never with these"
        )
    at_least("--timeout", timeout, 0.01)
    at_least("--contimeout", contimeout, 0.01)
    return S3Options(
        endpoint_url=endpoint,
        region=region,
        profile=profile,
        path_style=path_style,
        max_attempts=retries,
        read_timeout=timeout,
        connect_timeout=contimeout,
    )


# babel's settings: listing and comparing (ls, copy, sync, verify), then copying (copy, sync).
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
SrcArg = Annotated[str, typer.Argument(help="Source: a path or s3://bucket/prefix, or one file or object.")]
DstArg = Annotated[
    str, typer.Argument(help="Destination: a path or s3://bucket/prefix (for one file: a directory, or the new name).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would change; change nothing.")]
ChecksumOpt = Annotated[bool, typer.Option("--checksum", "-c", help="Compare CRC64NVME, not size + mtime.")]
SizeOnlyOpt = Annotated[bool, typer.Option("--size-only", help="Compare sizes only, not modification times.")]
IgnoreExistingOpt = Annotated[
    bool, typer.Option("--ignore-existing", help="Leave every object DST already has alone, whatever its size.")
]
FilesFromOpt = Annotated[
    Path | None,
    typer.Option(
        "--files-from",
        metavar="FILE",
        help="Only the source-relative names listed in FILE, one per line ('#' and ';' lines are comments).",
    ),
]
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
MaxDeleteOpt = Annotated[
    int | None,
    typer.Option(
        "--max-delete", metavar="N", help="Delete nothing if more than N would be deleted (default: no limit)."
    ),
]
DeleteOpt = Annotated[
    bool, typer.Option("--delete", hidden=True, help="Accepted for old scripts: sync always deletes.")
]
