"""``babel copy`` and ``babel sync`` from their options to a finished run, in two steps.

``plan_transfer`` does everything that may refuse the run before a byte moves: it reads the option texts
(``--bwlimit``, ``--part-size``, ``--shard``), decides what SRC means (a tree, or one file or object:
``single.plan``, one HEAD for an S3 source), refuses overlapping trees, and creates the state directory and a
local destination (``preflight.prepare``). ``PlannedTransfer.run`` then copies (``Syncer``) and returns the
``SyncResult``. A caller that shows progress starts showing it between the two, so a refused run draws
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lingctl.babel.bwlimit import TokenBucket, parse_rate
from lingctl.babel.filters import parse_shard, read_files_from
from lingctl.babel.overlap import check_no_overlap
from lingctl.babel.preflight import prepare
from lingctl.babel.sampling import DEFAULT_SAMPLES
from lingctl.babel.single import plan
from lingctl.babel.sync import Progress, Syncer, SyncOptions, SyncResult
from lingctl.core.storage import S3Options, StoreURL
from lingctl.core.units import parse_size


@dataclass(kw_only=True, slots=True)
class TransferConfig:
    """One ``babel copy`` (``delete=False``) or ``babel sync`` (``delete=True``), as its options were given."""

    src: str  # a path or s3:// URL: a tree, or one file or object
    dst: str
    s3: S3Options = field(default_factory=S3Options)
    delete: bool = False  # delete from DST what SRC lacks (never for a single-file SRC)
    max_delete: int | None = None
    dry_run: bool = False
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    checksum: bool = False
    jobs: int = 16
    part_size: str | None = None  # a size such as "64M"; None: adapts to each object
    verify: str = "sampled"  # none | sampled | full
    samples: int = DEFAULT_SAMPLES
    shard: str | None = None  # "I/N"; None: the whole key space
    commit_last: str | None = None
    state_dir: Path | None = None  # None: lingctl's cache directory
    bwlimit: str = "0"  # rclone's form, e.g. "10M" (MiB/s); "0" or "off": no limit
    size_only: bool = False
    ignore_existing: bool = False
    files_from: Path | None = None  # a list of source-relative names: only they are copied (or deleted)


@dataclass(frozen=True, slots=True)
class PlannedTransfer:
    """A run that passed every check before copying: its two roots and its options."""

    src: StoreURL
    dst: StoreURL
    s3: S3Options
    options: SyncOptions

    def run(self, progress: Progress | None = None) -> SyncResult:
        return Syncer(self.src, self.dst, self.s3, self.options, progress).run()


def plan_transfer(config: TransferConfig) -> PlannedTransfer:
    """Check ``config`` and prepare its run (see the module's docstring); ``UsageError`` and the other
    one-line errors for anything that refuses it."""
    rate = parse_rate(config.bwlimit)
    options = SyncOptions(
        dry_run=config.dry_run,
        delete=config.delete,
        max_delete=config.max_delete,
        include=list(config.include),
        exclude=list(config.exclude),
        checksum=config.checksum,
        jobs=config.jobs,
        part_size=parse_size(config.part_size) if config.part_size else None,
        verify=config.verify,
        samples=config.samples,
        shard=parse_shard(config.shard),
        commit_last=config.commit_last,
        state_dir=config.state_dir,
        limiter=TokenBucket(rate) if rate else None,
        size_only=config.size_only,
        ignore_existing=config.ignore_existing,
        files_from=read_files_from(config.files_from) if config.files_from is not None else None,
    )
    options.validate()
    p = plan(config.src, config.dst, config.s3)  # one HEAD for an S3 source: is it a single object?
    if p.objects is None:
        check_no_overlap(p.src, p.dst)
    else:
        options.objects, options.delete = p.objects, False  # one object: nothing else of DST is ours to delete
    options.state_dir = prepare(p.src, p.dst, config.state_dir, dry_run=config.dry_run)
    return PlannedTransfer(src=p.src, dst=p.dst, s3=config.s3, options=options)
