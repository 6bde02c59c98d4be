"""The flash tier: checkpoints land on a node-local disk first and are copied to durable storage behind.

A checkpoint directory is complete when it holds its commit marker (``marker.py``), written last by the
coordinator, which lists every other file with its size and CRC64NVME. Uploading keeps that rule at the
destination: each rank sends its own files, and the coordinator sends ``.metadata`` and then the marker only
once every listed file is there with the right size (and, where the store records one, the right CRC), so a
reader that finds the marker remotely finds a whole checkpoint. Transfers go through ``transfer.py``;
reading a checkpoint back is ``local_copy.py``.

Progress is recorded in lingctl's cache directory (``tier_status.state_dir``: ``$LINGCTL_CACHE_DIR`` or
``~/.cache/lingctl``, then ``pcache/state/<hash of the checkpoint's path>/``): one small JSON file per
uploading process (ranks on one node upload at the same time) and babel's journals. Nothing is written
inside or beside the checkpoint directory, so neither an upload nor a later sync of the run directory
carries tool state. Progress that older releases recorded in ``<parent>/.pcache/<name>/`` is still read.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.babel.sync import SyncResult
from lingctl.core.atomic import TMP_MARKER
from lingctl.core.errors import LingctlError, NotFoundError, RetryableError, UsageError, VerificationError
from lingctl.core.storage import ObjectStore, S3Options, StoreURL, open_store, parse_url
from lingctl.pcache.marker import (
    MARKER,
    METADATA,
    MODES,
    SIDECAR_GLOB,
    file_problems,
    is_data_file,
    read_marker,
    sidecar_files,
    sidecar_name,
)
from lingctl.pcache.tier_status import record, recorded_remote, remote_problems, remote_sizes
from lingctl.pcache.transfer import journal_dir, sync_files

__all__ = ["UploadResult", "Uploader", "finish_upload", "upload"]

log = logging.getLogger(__name__)


# -- upload -------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class UploadResult:
    local_dir: Path
    remote: str
    rank: int | None
    finalized: bool = False  # the marker is at the remote: the checkpoint is durable
    copied: int = 0
    copied_bytes: int = 0
    skipped: int = 0  # files already at the remote (a resumed or repeated upload)
    waited_s: float = 0.0  # time the coordinator spent waiting for other ranks' files
    seconds: float = 0.0

    def add(self, synced: SyncResult) -> None:
        self.copied += synced.copied
        self.copied_bytes += synced.copied_bytes
        self.skipped += synced.skipped


@dataclass(kw_only=True, slots=True)
class _Route:
    """One upload's two ends and how its files travel between them."""

    local_dir: Path
    local: StoreURL
    remote: StoreURL
    s3: S3Options
    journal: Path
    verify: str
    jobs: int

    def send(self, names: list[str], commit_last: str | None = None) -> SyncResult:
        return sync_files(
            self.local,
            self.remote,
            self.s3,
            names,
            journal=self.journal,
            verify=self.verify,
            jobs=self.jobs,
            commit_last=commit_last,
        )


def _own_files(local_dir: Path, rank: int | None) -> list[str]:
    """The files ``rank`` uploads (all but the coordinator's two when ``rank`` is None)."""
    present = {e.name for e in os.scandir(local_dir) if e.is_file() and TMP_MARKER not in e.name}
    if rank is None:
        return sorted(present - {MARKER, METADATA})
    names = {n for n in present if is_data_file(n, rank)}
    sidecar = sidecar_name(rank)
    if sidecar in present:
        names.add(sidecar)
        listed = sidecar_files(local_dir / sidecar)
        missing = sorted(set(listed) - present)
        if missing:
            raise NotFoundError(
                f"{local_dir}: {missing[0]} of rank {rank} is missing (listed in {sidecar})",
                hint="the save of this rank did not finish; its checkpoint cannot be uploaded",
            )
        names |= set(listed)
    return sorted(names)


def _expected(local_dir: Path, marker: dict[str, Any] | None) -> dict[str, dict]:
    """Recorded size and CRC of every file this node can vouch for: its sidecars, and the marker if here."""
    expected: dict[str, dict] = {}
    for sidecar in sorted(local_dir.glob(SIDECAR_GLOB)):
        if TMP_MARKER not in sidecar.name:
            expected.update(sidecar_files(sidecar))
    if marker is not None:
        expected.update(marker["files"])
    return expected


def upload(
    local_dir: Path,
    remote_url: str,
    s3: S3Options | None = None,
    *,
    rank: int | None = None,
    finalize: bool = True,
    verify: str = "full",
    timeout_s: float = 3600,
    jobs: int = 8,
) -> UploadResult:
    """Copy ``rank``'s files of ``local_dir`` to ``remote_url``; with ``finalize`` (the coordinator), also
    wait for every other rank's files and send ``.metadata`` and then the marker.

    Files already at the remote are skipped, so running it again after an interruption resumes. Local files
    are checked against their recorded CRCs first (``verify`` mode), so a damaged local copy never becomes
    the durable one. Raises ``RetryableError`` when other ranks' files do not arrive within ``timeout_s``.
    """
    if verify not in MODES:
        raise UsageError(f"verify must be one of {', '.join(MODES)}, got {verify!r}")
    local_dir = Path(local_dir).absolute()
    if not local_dir.is_dir():
        raise NotFoundError(f"checkpoint directory {local_dir} does not exist")
    remote = parse_url(remote_url)
    start = time.monotonic()
    result = UploadResult(local_dir=local_dir, remote=str(remote), rank=rank)
    tag = "all" if rank is None else f"rank{rank}"
    route = _Route(
        local_dir=local_dir,
        local=parse_url(str(local_dir)),
        remote=remote,
        s3=s3 or S3Options(),
        journal=journal_dir(local_dir, f"journal-{tag}", remote),
        verify=verify,
        jobs=jobs,
    )
    marker = read_marker(local_dir)
    if finalize and marker is None:  # refused before anything is recorded: the checkpoint stays "incomplete"
        raise VerificationError(
            f"{local_dir}: incomplete checkpoint (no {MARKER}), nothing to finalize",
            hint="the save did not finish; only complete checkpoints are made durable",
        )
    record(local_dir, rank, str(remote), "uploading")
    try:
        _send_own(route, rank, marker, result)
        if marker is not None and finalize:
            _finalize(route, marker, result, timeout_s=timeout_s)
    except BaseException as exc:
        record(local_dir, rank, str(remote), "failed", error=str(exc) or type(exc).__name__)
        raise
    result.finalized = finalize
    result.seconds = round(time.monotonic() - start, 3)
    _done(route, result)
    return result


def _done(route: _Route, result: UploadResult) -> None:
    """Record the finished upload, drop its journal, log what was sent."""
    phase = "durable" if result.finalized else "uploaded"
    record(route.local_dir, result.rank, str(route.remote), phase, copied_bytes=result.copied_bytes)
    # The journal only lets an interrupted run continue a half-sent file; once done it has nothing to offer,
    # and a re-run recognises finished files from the remote listing.
    shutil.rmtree(route.journal, ignore_errors=True)
    log.info(
        "%s: %d file(s) (%d bytes) sent to %s, %d already there%s",
        route.local_dir,
        result.copied,
        result.copied_bytes,
        route.remote,
        result.skipped,
        "; durable" if result.finalized else "",
    )


def _send_own(route: _Route, rank: int | None, marker: dict[str, Any] | None, result: UploadResult) -> None:
    """Check ``rank``'s files against what was recorded for them, then send them."""
    names = _own_files(route.local_dir, rank)
    problems = file_problems(route.local_dir, _expected(route.local_dir, marker), names, route.verify)
    if problems:
        raise VerificationError(
            f"{route.local_dir}: {problems[0]} ({len(problems)} problem(s)); nothing uploaded",
            hint="the local copy is damaged; save the checkpoint again",
        )
    if names:
        result.add(route.send(names))


def _finalize(route: _Route, marker: dict[str, Any], result: UploadResult, *, timeout_s: float) -> None:
    """The coordinator's last part: once every rank's files are at the remote and match the marker, send
    ``.metadata`` and then the marker itself."""
    files = {n: f for n, f in marker["files"].items() if n != METADATA}
    store = open_store(route.remote, route.s3)
    started = time.monotonic()
    sizes = _wait_for(store, files, route, timeout_s=timeout_s)
    result.waited_s = round(time.monotonic() - started, 3)
    problems = remote_problems(store, files, sizes)
    if problems:
        raise VerificationError(
            f"{route.remote}: {problems[0]} ({len(problems)} problem(s)); {MARKER} was not uploaded",
            hint="upload the damaged files again from the ranks that wrote them",
        )
    if METADATA in marker["files"] and not (route.local_dir / METADATA).is_file():
        raise NotFoundError(f"{route.local_dir}: {METADATA} is missing", hint="finalize on the coordinator's node")
    result.add(route.send([METADATA, MARKER], commit_last=MARKER))


def _wait_for(store: ObjectStore, files: dict[str, dict], route: _Route, *, timeout_s: float) -> dict[str, int]:
    """The remote's sizes once every one of ``files`` is there with its recorded size (polled with backoff);
    ``RetryableError`` after ``timeout_s``."""
    started = time.monotonic()
    delay = 0.1
    name = route.local_dir.name
    while True:
        sizes = remote_sizes(store)
        waiting = [n for n, f in sorted(files.items()) if sizes.get(n) != f["size"]]
        if not waiting:
            return sizes
        left = started + timeout_s - time.monotonic()
        if left <= 0:
            raise RetryableError(
                f"timed out after {timeout_s:g} s waiting for {len(waiting)} file(s) of {name} at {route.remote} "
                f"(first: {waiting[0]}); {MARKER} was not uploaded",
                hint="the ranks that wrote them must upload them; 'lingctl pcache upload DIR --to URL' on a node "
                "that holds them finishes the job",
            )
        log.debug("%s: waiting for %d file(s) of other ranks, e.g. %s", name, len(waiting), waiting[0])
        time.sleep(min(delay, left))
        delay = min(delay * 2, 5.0)


def finish_upload(
    local_dir: Path, remote_url: str | None, s3: S3Options | None = None, *, verify: str, timeout_s: float
) -> UploadResult:
    """Upload a whole checkpoint as its coordinator (``lingctl pcache upload``), or finish an interrupted
    upload: ``remote_url`` None sends it where its last upload went."""
    remote = remote_url or recorded_remote(local_dir)
    if remote is None:
        raise UsageError(f"no destination for {local_dir}: it was never uploaded", hint="give --to URL")
    return upload(local_dir, remote, s3, rank=None, finalize=True, verify=verify, timeout_s=timeout_s)


# -- the background uploader --------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Job:
    local_dir: Path
    remote_url: str
    s3: S3Options | None
    rank: int | None
    finalize: bool
    verify: str
    timeout_s: float
    on_durable: Callable[[str], None] | None = field(default=None, repr=False)


class Uploader:
    """Uploads checkpoints on one background thread, in the order they were submitted.

    Training goes on while a checkpoint is copied. A failed upload never ends the process on its own: the
    error is logged at once and raised from the next ``wait()``, where the caller decides. The thread is a
    daemon: if the process exits first, the upload stops where it was, shows as failed in ``status``, and
    ``upload`` (or ``lingctl pcache upload``) resumes it.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._cv = threading.Condition()
        self._pending = 0
        self._results: list[UploadResult] = []
        self._errors: list[Exception] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pcache-upload", daemon=True)
        self._thread.start()

    def submit(
        self,
        local_dir: Path,
        remote_url: str,
        s3: S3Options | None = None,
        *,
        rank: int | None = None,
        finalize: bool = True,
        on_durable: Callable[[str], None] | None = None,
        verify: str = "full",
        timeout_s: float = 3600,
    ) -> None:
        """Queue an ``upload``; ``on_durable(remote_url)`` runs on the upload thread once the marker is up."""
        with self._cv:
            if self._closed:
                raise UsageError("this uploader is closed", hint="create a new Uploader")
            self._pending += 1
        self._queue.put(
            _Job(
                local_dir=Path(local_dir),
                remote_url=remote_url,
                s3=s3,
                rank=rank,
                finalize=finalize,
                verify=verify,
                timeout_s=timeout_s,
                on_durable=on_durable,
            )
        )

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                result = upload(
                    job.local_dir,
                    job.remote_url,
                    job.s3,
                    rank=job.rank,
                    finalize=job.finalize,
                    verify=job.verify,
                    timeout_s=job.timeout_s,
                )
                if job.finalize and job.on_durable is not None:
                    job.on_durable(result.remote)
            except Exception as exc:  # kept for wait(): nothing may end the training process silently
                log.error("upload of %s to %s failed: %s", job.local_dir, job.remote_url, exc)
                with self._cv:
                    self._errors.append(exc)
            else:
                with self._cv:
                    self._results.append(result)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def pending(self) -> int:
        """Uploads submitted and not yet finished."""
        with self._cv:
            return self._pending

    def wait(self, timeout: float | None = None) -> list[UploadResult]:
        """Wait for every submitted upload; return their results, or raise the first error since the last wait."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending == 0, timeout):
                raise LingctlError(
                    f"{self._pending} checkpoint upload(s) still running after {timeout:g} s",
                    hint="wait longer, or check the network and the destination",
                )
            results, self._results = self._results, []
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            if isinstance(first, LingctlError):
                raise first
            raise LingctlError(f"checkpoint upload failed: {type(first).__name__}: {first}") from first
        return results

    def close(self) -> None:
        """Finish the queued uploads and stop the thread (errors stay for ``wait``)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
