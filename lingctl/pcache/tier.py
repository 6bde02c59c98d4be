"""The flash tier: checkpoints land on a node-local disk first and are copied to durable storage behind.

A checkpoint directory is complete when it holds ``pcache.json`` (the commit marker, written last by the
coordinator), which lists every other file with its size and CRC64NVME. Uploading keeps that rule at the
destination: each rank sends its own files, and the coordinator sends ``.metadata`` and then the marker only
once every listed file is there with the right size (and, where the store records one, the right CRC), so a
reader that finds the marker remotely finds a whole checkpoint. Transfers go through babel's ``Syncer``
(multipart, retries, verification, a journal that lets a re-run continue where an interrupted one stopped).

Progress is recorded in lingctl's cache directory (``tier_status.state_dir``: ``$LINGCTL_CACHE_DIR`` or
``~/.cache/lingctl``, then ``pcache/state/<hash of the checkpoint's path>/``): one small JSON file per
uploading process (ranks on one node upload at the same time) and babel's journals. Nothing is written
inside or beside the checkpoint directory, so neither an upload nor a later sync of the run directory
carries tool state. Progress that older releases recorded in ``<parent>/.pcache/<name>/`` is still read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.babel.sync import Syncer, SyncOptions, SyncResult
from lingctl.core.atomic import TMP_MARKER, atomic_write, tmp_path
from lingctl.core.cache import cache_dir as lingctl_cache_dir
from lingctl.core.checksum import crc64_file
from lingctl.core.errors import LingctlError, NotFoundError, RetryableError, UsageError, VerificationError, os_error
from lingctl.core.storage import S3Options, StoreURL, open_store, parse_url
from lingctl.pcache.tier_status import (
    MARKER,
    METADATA,
    check_file_name,
    check_files,
    ensure_state_dir,
    parse_marker,
    read_marker,
    record,
    recorded_remote,
    remote_problems,
    remote_sizes,
)

__all__ = [
    "MARKER",
    "UploadResult",
    "Uploader",
    "cache_path",
    "fetch",
    "read_marker",
    "recorded_remote",
    "resolve_for_read",
    "upload",
    "verify_local",
]

log = logging.getLogger(__name__)

# "sampled" checks the CRC of files up to this size and only the size of larger ones: the marker records one
# CRC per whole file, which sampled ranges cannot be compared against.
SAMPLED_CRC_MAX = 8 << 20
MODES = ("none", "sampled", "full")


# -- the marker and local verification ----------------------------------------------------------------------


def _bad_files(local_dir: Path, expected: dict[str, dict], names: Iterable[str], mode: str) -> dict[str, str]:
    """name -> what is wrong with it, for ``names`` in ``local_dir`` against ``expected`` (size, crc64nvme)."""
    if mode not in MODES:
        raise UsageError(f"verify mode must be one of {', '.join(MODES)}, got {mode!r}")
    bad: dict[str, str] = {}
    to_crc: list[tuple[str, str]] = []
    for name in sorted(names):
        want = expected.get(name)
        if want is None:
            continue  # nothing recorded to compare with (a sidecar is listed only in the marker)
        try:
            size = (local_dir / check_file_name(name, f"{local_dir}: file")).stat().st_size
        except FileNotFoundError:
            bad[name] = "missing"
            continue
        if size != want["size"]:
            bad[name] = f"{size} bytes, expected {want['size']}"
        elif want.get("crc64nvme") and (mode == "full" or (mode == "sampled" and size <= SAMPLED_CRC_MAX)):
            to_crc.append((name, want["crc64nvme"]))
    if to_crc:
        with ThreadPoolExecutor(min(4, len(to_crc)), thread_name_prefix="pcache-crc") as pool:
            crcs = pool.map(lambda item: crc64_file(local_dir / item[0]).tagged(), to_crc)
            for (name, want_crc), got in zip(to_crc, crcs):
                if got != want_crc:
                    bad[name] = f"checksum {got}, expected {want_crc}"
    return bad


def _file_problems(local_dir: Path, expected: dict[str, dict], names: Iterable[str], mode: str) -> list[str]:
    return [f"{name}: {what}" for name, what in _bad_files(local_dir, expected, names, mode).items()]


def verify_local(local_dir: Path, *, mode: str = "full") -> list[str]:
    """Problems that keep ``local_dir`` from being read as a checkpoint; empty when complete and verified.

    ``full`` compares every file's size and CRC64NVME with the marker; ``sampled`` compares sizes, and CRCs
    only of files up to 8 MiB (sidecars, ``.metadata``, small shards); ``none`` compares sizes only.
    """
    marker = read_marker(Path(local_dir))
    if marker is None:
        return [f"no {MARKER}: incomplete checkpoint (the save did not finish)"]
    return _file_problems(Path(local_dir), marker["files"], marker["files"], mode)


def _glob_literal(name: str) -> str:
    """An anchored babel include pattern for ``name``: exact, except that '[' becomes '?' (a class holding
    '[' is a nested set to Python's re). Checkpoint file names hold no '['; other names are only sent when a
    whole directory is (rank None), where matching one more of its files changes nothing."""
    return "/" + "".join({"*": "[*]", "?": "[?]", "[": "?"}.get(c, c) for c in name)


def _sync(
    src: StoreURL,
    dst: StoreURL,
    s3: S3Options,
    names: Iterable[str],
    *,
    journal: Path,
    verify: str,
    jobs: int,
    commit_last: str | None = None,
) -> SyncResult:
    opts = SyncOptions(
        include=[_glob_literal(n) for n in names], verify=verify, jobs=jobs, commit_last=commit_last, state_dir=journal
    )
    result = Syncer(src, dst, s3, opts).run()
    if result.failed:
        first = result.failed[0]
        kind = VerificationError if any(f.get("kind") == "verify" for f in result.failed) else RetryableError
        raise kind(
            f"{len(result.failed)} file(s) failed to copy to {dst}; first: {first['key']}: {first['error']}",
            hint="run the upload again: finished files are kept",
        )
    return result


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


def _own_files(local_dir: Path, rank: int | None) -> list[str]:
    """The files ``rank`` uploads (all but the coordinator's two when ``rank`` is None)."""
    present = {e.name for e in os.scandir(local_dir) if e.is_file() and TMP_MARKER not in e.name}
    if rank is None:
        return sorted(present - {MARKER, METADATA})
    names = {n for n in present if re.fullmatch(rf"__{rank}_\d+\.distcp", n)}
    sidecar = f"__{rank}.pcache.json"
    if sidecar in present:
        names.add(sidecar)
        listed = _sidecar_files(local_dir / sidecar)
        missing = sorted(set(listed) - present)
        if missing:
            raise NotFoundError(
                f"{local_dir}: {missing[0]} of rank {rank} is missing (listed in {sidecar})",
                hint="the save of this rank did not finish; its checkpoint cannot be uploaded",
            )
        names |= set(listed)
    return sorted(names)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise VerificationError(f"{path}: unreadable ({exc})", hint="the checkpoint is damaged") from None
    if not isinstance(data, dict):
        raise VerificationError(f"{path}: not a JSON object", hint="the checkpoint is damaged")
    return data


def _sidecar_files(path: Path) -> dict[str, dict]:
    """The files a rank's sidecar lists, each name and entry checked as a marker's are."""
    return check_files(_read_json(path).get("files", {}), str(path))


def _expected(local_dir: Path, marker: dict[str, Any] | None) -> dict[str, dict]:
    """Recorded size and CRC of every file this node can vouch for: its sidecars, and the marker if here."""
    expected: dict[str, dict] = {}
    for sidecar in sorted(local_dir.glob("__*.pcache.json")):
        if TMP_MARKER not in sidecar.name:
            expected.update(_sidecar_files(sidecar))
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
    s3 = s3 or S3Options()
    remote = parse_url(remote_url)
    start = time.monotonic()
    result = UploadResult(local_dir=local_dir, remote=str(remote), rank=rank)
    tag = "all" if rank is None else f"rank{rank}"
    journal = ensure_state_dir(local_dir) / f"journal-{tag}-{hashlib.sha256(str(remote).encode()).hexdigest()[:12]}"
    marker = read_marker(local_dir)
    if finalize and marker is None:  # refused before anything is recorded: the checkpoint stays "incomplete"
        raise VerificationError(
            f"{local_dir}: incomplete checkpoint (no {MARKER}), nothing to finalize",
            hint="the save did not finish; only complete checkpoints are made durable",
        )
    record(local_dir, rank, str(remote), "uploading")
    try:
        names = _own_files(local_dir, rank)
        problems = _file_problems(local_dir, _expected(local_dir, marker), names, verify)
        if problems:
            raise VerificationError(
                f"{local_dir}: {problems[0]} ({len(problems)} problem(s)); nothing uploaded",
                hint="the local copy is damaged; save the checkpoint again",
            )
        local = parse_url(str(local_dir))
        if names:
            _add(result, _sync(local, remote, s3, names, journal=journal, verify=verify, jobs=jobs))
        if finalize:
            assert marker is not None
            _finalize(
                local_dir,
                local,
                remote,
                s3,
                marker,
                result,
                journal=journal,
                verify=verify,
                jobs=jobs,
                timeout_s=timeout_s,
            )
    except BaseException as exc:
        record(local_dir, rank, str(remote), "failed", error=str(exc) or type(exc).__name__)
        raise
    result.finalized = finalize
    result.seconds = round(time.monotonic() - start, 3)
    record(local_dir, rank, str(remote), "durable" if finalize else "uploaded", copied_bytes=result.copied_bytes)
    # The journal only lets an interrupted run continue a half-sent file; once done it has nothing to offer,
    # and a re-run recognises finished files from the remote listing.
    shutil.rmtree(journal, ignore_errors=True)
    log.info(
        "%s: %d file(s) (%d bytes) sent to %s, %d already there%s",
        local_dir,
        result.copied,
        result.copied_bytes,
        remote,
        result.skipped,
        "; durable" if finalize else "",
    )
    return result


def _add(result: UploadResult, synced: SyncResult) -> None:
    result.copied += synced.copied
    result.copied_bytes += synced.copied_bytes
    result.skipped += synced.skipped


def _finalize(
    local_dir: Path,
    local: StoreURL,
    remote: StoreURL,
    s3: S3Options,
    marker: dict[str, Any],
    result: UploadResult,
    *,
    journal: Path,
    verify: str,
    jobs: int,
    timeout_s: float,
) -> None:
    files = {n: f for n, f in marker["files"].items() if n != METADATA}
    store = open_store(remote, s3)
    started = time.monotonic()
    delay = 0.1
    while True:
        sizes = remote_sizes(store)
        waiting = [n for n, f in sorted(files.items()) if sizes.get(n) != f["size"]]
        if not waiting:
            break
        left = started + timeout_s - time.monotonic()
        if left <= 0:
            raise RetryableError(
                f"timed out after {timeout_s:g} s waiting for {len(waiting)} file(s) of {local_dir.name} at {remote} "
                f"(first: {waiting[0]}); {MARKER} was not uploaded",
                hint="the ranks that wrote them must upload them; 'lingctl pcache upload DIR --to URL' on a node "
                "that holds them finishes the job",
            )
        log.debug("%s: waiting for %d file(s) of other ranks, e.g. %s", local_dir.name, len(waiting), waiting[0])
        time.sleep(min(delay, left))
        delay = min(delay * 2, 5.0)
    result.waited_s = round(time.monotonic() - started, 3)
    problems = remote_problems(store, files, sizes)
    if problems:
        raise VerificationError(
            f"{remote}: {problems[0]} ({len(problems)} problem(s)); {MARKER} was not uploaded",
            hint="upload the damaged files again from the ranks that wrote them",
        )
    if METADATA in marker["files"] and not (local_dir / METADATA).is_file():
        raise NotFoundError(f"{local_dir}: {METADATA} is missing", hint="finalize on the coordinator's node")
    _add(
        result,
        _sync(local, remote, s3, [METADATA, MARKER], journal=journal, verify=verify, jobs=jobs, commit_last=MARKER),
    )


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


# -- reading: prefer the local copy -------------------------------------------------------------------------


def fetch(remote_url: str, local_dir: Path, s3: S3Options | None = None, *, jobs: int = 8) -> Path:
    """Bring the checkpoint at ``remote_url`` into ``local_dir``: only files missing or failing verification
    are copied, each is checked against the remote marker, and the marker is written last."""
    local_dir = Path(local_dir).absolute()
    s3 = s3 or S3Options()
    remote = parse_url(remote_url)
    store = open_store(remote, s3)
    try:
        raw = store.read(MARKER)
    except NotFoundError:
        raise NotFoundError(
            f"{remote}: no {MARKER}, so not a complete checkpoint",
            hint="its upload may not have finished; check 'lingctl pcache status'",
        ) from None
    files = parse_marker(raw, f"{remote}/{MARKER}")["files"]
    stale = sorted(_bad_files(local_dir, files, files, "full"))
    aside: list[Path] = []
    try:
        if stale:
            # Until every file is right, the local directory must not look complete: marker first, then the
            # rest. Moved aside, not overwritten in place (babel skips a file of the same size and mtime),
            # under lingctl's temporary names, which no listing shows; removed once the replacements are in,
            # so a replacement is always a new file (a new inode), never the old one's reused number. The
            # names were checked by parse_marker (one plain segment each); checked again where joined.
            for name in [MARKER, *stale]:
                _move_aside(local_dir / check_file_name(name, f"{remote}/{MARKER}: file"), aside)
            # babel's own check would compare against the bytes it just read; the marker's CRCs, checked
            # next, are the ones the writer recorded, so they also catch an object damaged at the remote.
            journal = ensure_state_dir(local_dir) / f"fetch-{hashlib.sha256(str(remote).encode()).hexdigest()[:12]}"
            _sync(remote, parse_url(str(local_dir)), s3, stale, journal=journal, verify="none", jobs=jobs)
            shutil.rmtree(journal, ignore_errors=True)
            problems = _file_problems(local_dir, files, stale, "full")
            if problems:
                raise VerificationError(
                    f"{remote}: fetched copy of {problems[0]}",
                    hint="the remote copy is damaged; upload it again from a verified local copy",
                )
        local_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(local_dir / MARKER) as (_, f):
            f.write(raw)
    finally:
        for path in aside:
            path.unlink(missing_ok=True)
    log.info("fetched %d of %d file(s) of %s into %s", len(stale), len(files), remote, local_dir)
    return local_dir


def _move_aside(path: Path, aside: list[Path]) -> None:
    """Rename ``path`` (if present) to a temporary name beside it, recorded in ``aside``."""
    tmp = tmp_path(path)
    try:
        os.rename(path, tmp)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    aside.append(tmp)


def default_cache_dir() -> Path:
    return lingctl_cache_dir("pcache")


def cache_path(url: str, cache_dir: Path | str | None) -> Path:
    """The node-local directory that mirrors the checkpoint at ``url``: ``s3://bucket/key`` ->
    ``CACHE/bucket/key``; a path (a shared filesystem) -> ``CACHE/<the path without its leading />``."""
    parsed = parse_url(url)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if parsed.is_s3:
        return base / parsed.bucket / parsed.prefix.strip("/")
    return base / parsed.path.absolute().relative_to("/")


def resolve_for_read(url: str, *, cache_dir: Path | None, s3: S3Options | None = None, exact: bool = False) -> Path:
    """The local directory to read the checkpoint at ``url`` from.

    Whatever is returned has been verified in full: every file its marker lists (``.metadata`` among them)
    has the recorded size and CRC64NVME. A local path is read in place (it must hold its marker; every byte
    is read once to check it). For s3:// the copy at ``cache_path(url, cache_dir)`` (``exact``: at
    ``cache_dir`` itself) is used when it is complete and verifies against its own marker (no request to the
    remote); otherwise the missing or damaged files are fetched into it and checked against the remote
    marker. ``cache_dir`` None: ``$LINGCTL_CACHE_DIR/pcache``.
    """
    parsed = parse_url(url)
    if not parsed.is_s3:
        path = parsed.path.absolute()
        if not path.is_dir():
            raise NotFoundError(f"checkpoint directory {path} does not exist")
        if read_marker(path) is None:
            raise VerificationError(
                f"{path}: incomplete checkpoint (no {MARKER})", hint="the save did not finish; read an earlier step"
            )
        problems = _read_problems(path)
        if problems:
            raise VerificationError(
                f"{path}: {problems[0]} ({len(problems)} problem(s)); refusing to load it",
                hint="the checkpoint is damaged or was changed after it was saved; read an earlier step",
            )
        return path
    if not parsed.prefix:
        raise UsageError(f"{url} names a bucket, not a checkpoint", hint="give s3://bucket/path/to/checkpoint")
    local = Path(cache_dir) if exact and cache_dir is not None else cache_path(url, cache_dir)
    try:
        problems = _read_problems(local) if local.is_dir() else ["no local copy"]
    except (VerificationError, UsageError) as exc:  # a damaged or unsafe marker: the fetch below replaces it
        problems = [str(exc)]
    if not problems:
        log.info("reading %s from its local copy %s", url, local)
        return local
    log.info("local copy %s of %s not usable (%s): fetching", local, url, problems[0])
    fetch(url, local, s3)
    problems = _read_problems(local)
    if problems:
        raise VerificationError(
            f"{url}: {problems[0]}; refusing to load it", hint="the remote checkpoint is not one lingctl saved whole"
        )
    log.info("reading %s from %s (fetched)", url, local)
    return local


def _read_problems(local_dir: Path) -> list[str]:
    """``verify_local`` in full, plus what a reader needs beyond it: the marker lists ``.metadata``."""
    problems = verify_local(local_dir, mode="full")
    marker = read_marker(local_dir)
    if marker is not None and METADATA not in marker["files"]:
        problems.insert(0, f"{METADATA}: not listed in {MARKER}")
    return problems
