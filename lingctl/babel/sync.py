"""``babel sync``: make the destination equal to the source.

list destination (parallel, into an index) -> stream the source listing (parallel, in batches) -> for each
source object decide copy/skip against the index and the journal -> copy on a thread pool while the
listing continues -> verify each copy -> copy the --commit-last objects -> delete (only with
``SyncOptions.delete``, as ``babel sync`` sets it; never more than --max-delete, never after a failed copy,
never from an S3 source prefix with nothing under it). ``SyncOptions.objects`` copies named objects (a
single-file source) instead of listing trees.

Skipping needs no request per object (``decide.CopyDecision``): the journal remembers what babel wrote (size,
source mtime, CRC, destination etag), so an unchanged tree re-syncs from the two listings alone. ``run``
takes ``babel copy`` and ``babel sync`` from their options to a ``Syncer``.

Failures are per object and the run goes on, except a full disk (``DiskFullError``), which stops it: every
further write would fail the same way. ``SyncResult.failure`` turns the failed objects into the run's error:
exit 4 if a copy failed verification, 1 if any failure will happen again as it stands (a refused name,
permission denied), 5 only when every failure was one that retrying can fix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lingctl.babel.bwlimit import TokenBucket
from lingctl.babel.copy_queue import CopyQueue
from lingctl.babel.decide import CopyDecision
from lingctl.babel.filters import KeyFilter
from lingctl.babel.index import ListingIndex
from lingctl.babel.journal import Journal
from lingctl.babel.listing import Listed, ListStats, list_tree
from lingctl.babel.sampling import DEFAULT_SAMPLES
from lingctl.babel.single import RenamedKeys
from lingctl.babel.transfer import Item, check_copy, copy_object
from lingctl.core.atomic import sweep_stale
from lingctl.core.cache import cache_dir
from lingctl.core.errors import (
    DiskFullError,
    LingctlError,
    NotFoundError,
    RetryableError,
    UsageError,
    VerificationError,
)
from lingctl.core.names import printable
from lingctl.core.storage import Aimd, ObjectStore, S3Options, StoreURL, open_store

log = logging.getLogger(__name__)

STATE_DIR_NAME = ".lingctl-babel"


def state_dir_for(dst: StoreURL, explicit: Path | None) -> Path:
    """Where the journal lives: --state-dir, else a per-destination directory in lingctl's cache, never
    inside the destination (a user's tree holds only the user's files). Local destinations are named by
    their real path, so ``./dst`` and ``/abs/dst`` share one journal. Older runs kept it in
    ``DST/.lingctl-babel/``: that directory is still never listed, copied or deleted, and may be removed."""
    if explicit is not None:
        return Path(explicit)
    name = str(dst) if dst.is_s3 else "file://" + os.path.realpath(os.path.abspath(dst.path))
    return cache_dir("babel") / hashlib.sha256(name.encode()).hexdigest()[:16]


@dataclass(kw_only=True, slots=True)
class SyncOptions:
    dry_run: bool = False
    delete: bool = False
    max_delete: int | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    checksum: bool = False
    jobs: int = 16
    part_size: int | None = None
    verify: str = "sampled"  # none | sampled | full
    samples: int = DEFAULT_SAMPLES
    shard: tuple[int, int] = (0, 1)
    commit_last: str | None = None
    state_dir: Path | None = None
    # Only these source keys, each copied to its destination key (a single-file source, rclone's copyto);
    # nothing is listed on either side, and nothing is deleted. None: the whole tree.
    objects: dict[str, str] | None = None
    limiter: TokenBucket | None = None  # --bwlimit: charged with the bytes of every copy
    size_only: bool = False  # --size-only: equal sizes are equal
    ignore_existing: bool = False  # --ignore-existing: never replace what DST has
    files_from: frozenset[str] | None = None  # --files-from: only these keys (and only they may be deleted)

    def validate(self) -> None:
        if self.jobs < 1:
            raise UsageError(f"--jobs must be at least 1, got {self.jobs}")
        if self.verify not in ("none", "sampled", "full"):
            raise UsageError(f"--verify must be none, sampled or full, got {self.verify!r}")
        if self.max_delete is not None and self.max_delete < 0:
            raise UsageError(f"--max-delete must be >= 0, got {self.max_delete}")
        if self.objects is not None and self.delete:
            raise UsageError("deleting is for whole trees; a copy of single objects never deletes")
        chosen = [name for name, on in _COMPARE.items() if getattr(self, on)]
        if len(chosen) > 1:
            raise UsageError(f"{' and '.join(chosen)} contradict each other: give one way to compare")


# How to tell an object needs copying, rclone's options: at most one of them.
_COMPARE = {"--checksum": "checksum", "--size-only": "size_only", "--ignore-existing": "ignore_existing"}


@dataclass(kw_only=True, slots=True)
class SyncResult:
    source: str
    destination: str
    dry_run: bool
    listed_source: int = 0
    listed_destination: int = 0
    copied: int = 0
    copied_bytes: int = 0
    skipped: int = 0
    deleted: int = 0
    verified: int = 0
    verify_mode: str = "sampled"
    failed: list[dict[str, str]] = field(default_factory=list)
    would_copy: list[str] = field(default_factory=list)
    would_copy_bytes: int = 0
    would_delete: list[str] = field(default_factory=list)
    deletes_skipped: str | None = None
    list_requests: int = 0
    head_requests: int = 0
    requests: int = 0
    retries: int = 0
    throttled: int = 0
    min_concurrency: int = 0
    resumed_parts: int = 0  # multipart parts of an interrupted run that were kept, not sent again
    # Copies started over: the source changed under a pinned read, or the server forgot the upload.
    restarts: int = 0
    removed_temp_files: int = 0  # left by a previous run that did not end (kill -9, a crash)
    seconds: float = 0.0
    journal: str = ""

    def failure(self) -> LingctlError | None:
        """The error this run ends with, if any object failed: exit 4 when a copy failed verification; 1
        when a failure will recur as it stands (its message says so); 5 only when every failure is one that
        running the same command again can fix."""
        failed = [f for f in self.failed if f.get("kind") != "held"]
        if not failed:
            return None
        count = f"{len(self.failed)} object(s) failed"

        def first(kind: str) -> str:
            f = next(f for f in failed if f.get("kind") == kind)
            return f"{f['key']}: {f['error']}"

        kinds = {f.get("kind") for f in failed}
        if "verify" in kinds:
            return VerificationError(
                f"{count}; first to fail verification: {first('verify')}",
                hint="a copy that differs is copied again by the same command (if that "
                "recurs, check the destination's storage); a refused name fails "
                "again until the source object is renamed",
            )
        if "error" in kinds:
            return LingctlError(
                f"{count}; this failure will happen again as it stands: {first('error')}",
                hint="fix its cause (name, permission, space), then run the same command again; "
                "finished objects are kept",
            )
        return RetryableError(
            f"{count}; first: {first('retryable')}",
            hint="run the same command again: finished objects and parts are kept",
        )


# ("listed" | "checked" | "queued" | "copied" | "bytes" | "failed", amount); called from many threads
Progress = Callable[[str, int], None]


class Syncer:
    """One run from ``src_url`` to ``dst_url`` (see the module's docstring); ``progress`` is told what
    happens as it happens."""

    def __init__(
        self, src_url: StoreURL, dst_url: StoreURL, s3: S3Options, opts: SyncOptions, progress: Progress | None = None
    ) -> None:
        opts.validate()
        self.src_url, self.dst_url, self.s3, self.opts = src_url, dst_url, s3, opts
        self.progress = progress or (lambda kind, n: None)
        self.gate = Aimd(opts.jobs)
        self.src: ObjectStore = open_store(src_url, s3, gate=self.gate)
        self.dst: ObjectStore = open_store(dst_url, s3, gate=self.gate)
        self.filter = KeyFilter(list(opts.include), list(opts.exclude), opts.shard, opts.files_from)
        self.result = SyncResult(
            source=self.src.describe(), destination=self.dst.describe(), dry_run=opts.dry_run, verify_mode=opts.verify
        )
        self._lock = threading.Lock()
        self._replacing: dict[str, bool] = {}  # queued keys: whether DST already had them (the -v line says)
        self._fatal: DiskFullError | None = None  # a full disk stops the run: every further write would fail

    # -- the run --------------------------------------------------------------------------------------
    def run(self) -> SyncResult:
        start = time.monotonic()
        self._open()
        stats = ListStats()
        index = ListingIndex()
        src_seen = ListingIndex() if self.opts.delete else None
        ended = False
        try:
            self._index_destination(index, stats)
            self._copy_source(index, src_seen, stats)
            if self._fatal is not None:
                raise self._fatal
            self.result.list_requests = stats.requests
            self._finish(index, src_seen)
            ended = True
        finally:
            index.close()
            if src_seen is not None:
                src_seen.close()
            try:
                self.journal.close()
            except LingctlError:
                if ended:
                    raise  # else an error already on its way (a full disk) says more than the journal's
        self._count_requests(stats)
        self.result.seconds = round(time.monotonic() - start, 3)
        return self.result

    def _open(self) -> None:
        """Check both roots, create a local destination, open the journal and, after a run that did not
        end, remove the temporary files it left in a local destination."""
        self.src.check()
        if self.dst.local_root is not None:
            if not self.opts.dry_run:
                self.dst.local_root.mkdir(parents=True, exist_ok=True)
        else:
            self.dst.check()
        journal_path = state_dir_for(self.dst_url, self.opts.state_dir) / "journal.sqlite"
        # A dry run creates nothing: without a journal yet it plans against an empty one in memory.
        self.journal = Journal(None if self.opts.dry_run and not journal_path.exists() else journal_path)
        self.result.journal = str(journal_path)
        if self.opts.dry_run:
            return
        try:
            unfinished = self.journal.begin_run()
        except LingctlError:
            self.journal.close()
            raise
        if unfinished and self.dst.local_root is not None:
            # Only after a run that did not end: a walk of the whole destination is not free.
            removed = sweep_stale(self.dst.local_root, skip_dirs={STATE_DIR_NAME})
            self.result.removed_temp_files = len(removed)
            if removed:
                log.info("removed %d temporary file(s) left by an earlier run", len(removed))

    def _index_destination(self, index: ListingIndex, stats: ListStats) -> None:
        if self.opts.objects is not None:  # single objects: look at their destinations alone, list nothing
            index.add_many(self._versions(self.dst, self.opts.objects.values()))
        elif self.dst.local_root is None or self.dst.local_root.is_dir():
            for batch in self._list(self.dst_url, stats):
                index.add_many((e.key, e.size, e.mtime, e.etag) for e in batch)
        self.result.listed_destination = index.count

    def _list(self, url: StoreURL, stats: ListStats) -> Iterator[list[Listed]]:
        return list_tree(
            url,
            self.s3,
            jobs=self.opts.jobs,
            stats=stats,
            skip_dirs=frozenset({STATE_DIR_NAME}),
            on_unreadable=self._unreadable,
        )

    def _copy_source(self, index: ListingIndex, src_seen: ListingIndex | None, stats: ListStats) -> None:
        """Stream the source listing, deciding each object against the index and the journal, and copy
        on a pool while the listing goes on; the --commit-last objects after everything else."""
        deferred: list[Item] = []
        with (
            ThreadPoolExecutor(self.opts.jobs, thread_name_prefix="babel-obj") as objects,
            ThreadPoolExecutor(self.opts.jobs, thread_name_prefix="babel-part") as parts,
        ):
            self._parts = parts
            copies = CopyQueue(objects, self.opts.jobs)
            batches = self._source_batches(stats)  # for single objects, a view of the source under new names
            decide = CopyDecision(
                self.src,
                self.dst,
                self.journal.all_done(),
                checksum=self.opts.checksum,
                size_only=self.opts.size_only,
                ignore_existing=self.opts.ignore_existing,
            )
            for batch in batches:
                self.result.listed_source += len(batch)
                self.progress("listed", len(batch))
                if src_seen is not None:
                    src_seen.add_many((e.key, e.size, e.mtime, None) for e in batch)
                if self._fatal is not None:
                    break
                self.progress("checked", self._schedule(batch, index, decide, copies, deferred))
            self.result.head_requests = decide.heads
            copies.wait()
            self._copy_deferred(deferred)

    def _schedule(
        self, batch: list[Listed], index: ListingIndex, decide: CopyDecision, copies: CopyQueue, deferred: list[Item]
    ) -> int:
        """Hand the objects of ``batch`` that need a copy to the pool (or, in a dry run, to the plan; the
        --commit-last ones to ``deferred``); returns how many passed the filters."""
        checked = 0
        for e in batch:
            if not self.filter(e.key):
                continue
            checked += 1
            item = Item(e.key, e.size, e.mtime, e.etag)
            existing = index.get(e.key)
            if not decide.needs_copy(item, existing):
                self.result.skipped += 1
                log.debug("%s: Unchanged skipping", e.key)
            elif self.opts.dry_run:
                self.result.would_copy.append(e.key)
                self.result.would_copy_bytes += e.size
                log.info("%s: Skipped copy as --dry-run is set (size %d)", e.key, e.size)
            elif self.opts.commit_last and self._is_commit_last(e.key):
                deferred.append(item)
                self._replacing[e.key] = existing is not None
            else:
                self.progress("queued", e.size)
                self._replacing[e.key] = existing is not None
                copies.submit(self._copy, item)
        return checked

    def _copy_deferred(self, deferred: list[Item]) -> None:
        """The --commit-last objects, once everything else is copied and verified; held back when anything
        failed, so their presence means the rest is complete."""
        if not deferred or self._fatal is not None:
            return
        if self.result.failed:
            for item in deferred:
                self.result.failed.append(
                    {
                        "key": item.key,
                        "error": "held back: other objects failed, so the commit-last object was not copied",
                        "kind": "held",
                    }
                )
            return
        for item in deferred:
            self.progress("queued", item.size)
            self._copy(item)

    def _finish(self, index: ListingIndex, src_seen: ListingIndex | None) -> None:
        if self.opts.delete and not self.result.listed_source and self.src_url.is_s3 and self.src_url.prefix:
            # S3 has no directories: an empty prefix is most likely a typo, and a sync from it would empty
            # the destination. rclone refuses it the same way ("directory not found").
            raise NotFoundError(
                f"{self.src_url}: no objects under this prefix (directory not found); nothing was deleted",
                hint="check the source URL",
            )
        if src_seen is not None:  # exactly when deleting
            self._delete(index, src_seen)
        if not self.opts.dry_run:
            self.journal.end_run()

    def _count_requests(self, stats: ListStats) -> None:
        counters = [c for c in (self.src.request_counters, self.dst.request_counters) if c is not None]
        self.result.requests = sum(c.requests for c in counters) + self.result.list_requests
        self.result.retries = sum(c.retries for c in counters) + stats.retries
        self.result.throttled = sum(c.throttled for c in counters)
        self.result.min_concurrency = int(self.gate.lowest)

    def _source_batches(self, stats: ListStats) -> Iterator[list[Listed]]:
        """The source listing in batches; for single objects, one batch of them under their destination
        keys, read through a view of the source that maps those keys back (rclone's copyto)."""
        names = self.opts.objects
        if names is None:
            return self._list(self.src_url, stats)
        renamed = {d: s for s, d in names.items() if d != s}
        if renamed:
            self.src = RenamedKeys(self.src, renamed)  # type: ignore[assignment]
        versions = self._versions(self.src, names.values())
        missing = [s for s, d in names.items() if d not in {v[0] for v in versions}]
        if missing:
            raise NotFoundError(f"{self.src_url.join(missing[0])}: no such file or object")
        return iter([[Listed(key, size, mtime, etag) for key, size, mtime, etag in versions]])

    @staticmethod
    def _versions(side: ObjectStore, keys: Iterable[str]) -> list[tuple[str, int, float, str | None]]:
        """(key, size, mtime, etag) of each key that exists, exactly as a listing would show it."""
        found = []
        for key in keys:
            v = side.version(key)
            if v is not None:
                found.append((key, v.size, v.mtime, v.etag))
        return found

    def _is_commit_last(self, key: str) -> bool:
        name = self.opts.commit_last or ""
        return key == name or key.rsplit("/", 1)[-1] == name

    # -- doing ----------------------------------------------------------------------------------------
    def _copy(self, item: Item) -> None:
        if self._fatal is not None:
            return  # the disk is full: this copy would fail the same way
        try:
            # Sampled verification of an object copied to S3 is the server's own check of the MD5 of each
            # request's body (Content-MD5, as rclone sends it): the bytes it stored are the bytes that were
            # read, and no read-back is needed. Local destinations and --verify full read back. The digest
            # is sent with --verify none too, as rclone always sends it: rclone serve s3 spends less CPU on a
            # PUT that carries one (5.4 s instead of 8.6 s for the 2,000-file benchmark copy).
            item, done, checked = copy_object(
                self.src,
                self.dst,
                item,
                journal=self.journal,
                part_size=self.opts.part_size,
                parts_pool=self._parts,
                on_resumed=self._count_resumed,
                on_restart=self._count_restart,
                server_check=self.opts.verify != "full",
                on_bytes=self._moved,
            )
            self.journal.mark_done(item.key, done)
            if not checked:
                check_copy(self.src, self.dst, item, done, self.opts.verify, self.opts.samples)
        except DiskFullError as exc:
            self._stop(exc)
            return
        except LingctlError as exc:
            self._failed(item, exc)
            return
        with self._lock:
            self.result.copied += 1
            self.result.copied_bytes += item.size
            if self.opts.verify != "none":
                self.result.verified += 1
            replaced = self._replacing.pop(item.key, False)
        # rclone's -v lines, one per object
        log.info("%s: Copied (%s)", item.key, "replaced existing" if replaced else "new")
        self.progress("copied", 1)

    def _failed(self, item: Item, exc: LingctlError) -> None:
        """A copy that failed: recorded with its kind, and forgotten by the journal."""
        log.warning("%s: %s", item.key, exc)
        try:
            self.journal.forget(item.key)
        except DiskFullError as full:
            self._stop(full)
        with self._lock:
            self.result.failed.append(
                {
                    "key": item.key,
                    "error": str(exc),
                    "kind": "verify" if exc.exit_code == 4 else ("retryable" if exc.retryable else "error"),
                }
            )
        self.progress("failed", 1)

    def _stop(self, exc: DiskFullError) -> None:
        """A full disk stops the run: every further write would fail the same way."""
        with self._lock:
            self._fatal = self._fatal or exc

    def _moved(self, n: int) -> None:
        """``n`` more bytes of a copy went through: held back to ``--bwlimit``, then counted for progress.
        Called after each part of a multipart copy, so a large object is paced part by part."""
        if self.opts.limiter is not None:
            self.opts.limiter.take(n)
        self.progress("bytes", n)

    def _unreadable(self, path: str, err: LingctlError) -> None:
        """A directory either listing could not read: the rest goes on, the run fails (exit 1), and since
        the listing is incomplete, nothing is deleted (``_delete`` runs only when nothing failed)."""
        log.warning("%s", err)
        with self._lock:
            self.result.failed.append({"key": printable(path), "error": f"could not be listed: {err}", "kind": "error"})
        self.progress("failed", 1)

    def _count_resumed(self, n: int) -> None:
        with self._lock:
            self.result.resumed_parts += n

    def _count_restart(self, n: int) -> None:
        with self._lock:
            self.result.restarts += n

    def _delete(self, index: ListingIndex, src_seen: ListingIndex) -> None:
        doomed = [k for k, _ in index.items() if self.filter(k) and k not in src_seen]
        if not doomed:
            return
        if self.opts.dry_run:
            self.result.would_delete = doomed
            return
        if self.result.failed:
            self.result.deletes_skipped = f"{len(doomed)} deletion(s) skipped because copies failed"
            return
        if self.opts.max_delete is not None and len(doomed) > self.opts.max_delete:
            raise LingctlError(
                f"sync would delete {len(doomed)} objects, more than --max-delete "
                f"{self.opts.max_delete}; nothing was deleted",
                hint="check the source, or raise --max-delete",
            )
        for key in doomed:
            self.dst.delete(key)
            self.journal.forget(key)
            self.result.deleted += 1
            log.info("%s: Deleted", key)
