"""Copying one object between two stores, with its CRC64NVME computed on the way, and checking it after.

Small objects go in one request. Larger ones are cut into parts whose size adapts to the object (at most
``MAX_PARTS`` parts), read and written in parallel; the part CRCs are combined into the full-object CRC
(CRC combination, so parts need not be hashed in order). On an S3 destination the journal records each
finished part, so a re-run continues a half-done upload instead of starting it again.

Every read of one copy is pinned to the source version that was listed (``core.storage.Version``), so a source
overwritten during the copy never yields a mix of two versions: the copy starts again from the new version,
at most ``SOURCE_ATTEMPTS`` times. A multipart upload the server has forgotten (restarted, or aborted by a
lifecycle rule) is started again under a new id, at most ``UPLOAD_ATTEMPTS`` times.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lingctl.babel.journal import Done, Journal, Upload
from lingctl.babel.sampling import sample_ranges
from lingctl.core.checksum import Crc64, crc64_bytes
from lingctl.core.errors import RetryableError, UsageError, VerificationError
from lingctl.core.storage import MultipartUploads, ObjectStore, SourceChangedError, UploadGoneError, Version

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART = 8 * MiB
MAX_PARTS = 1000  # S3 allows 10,000; fewer, larger parts keep per-request overhead low
# Copies of one object started over because its source changed under them (then the object is reported
# as changing: exit 5, a later run copies it once it holds still), or because its upload was forgotten.
SOURCE_ATTEMPTS = 3
UPLOAD_ATTEMPTS = 3


def part_size_for(size: int, requested: int | None) -> int:
    """The requested part size (or 8 MiB), grown so an object never needs more than MAX_PARTS parts."""
    base = max(5 * MiB, requested or MIN_PART)
    need = math.ceil(size / MAX_PARTS)
    return max(base, math.ceil(need / MiB) * MiB)


@dataclass(slots=True)
class Item:
    key: str
    size: int
    mtime: float
    etag: str | None = None  # the source's ETag as listed (S3 sources)

    @property
    def version(self) -> Version:
        return Version(self.size, self.mtime, self.etag)


Notify = Callable[[int], None]


def copy_object(
    src: ObjectStore,
    dst: ObjectStore,
    item: Item,
    *,
    journal: Journal,
    part_size: int | None,
    parts_pool: ThreadPoolExecutor,
    on_resumed: Notify | None = None,
    on_restart: Notify | None = None,
    server_check: bool = False,
    on_bytes: Notify | None = None,
) -> tuple[Item, Done, bool]:
    """Copy ``item``; returns the version copied (the listed one, or a newer one if the source changed during
    the copy), what the journal records for it, and whether the destination's server checked the body it
    received (``server_check`` on a store that ``checks_bodies``: every request of this copy carried the
    body's MD5, as rclone sends it, for the server to check). Raises
    on failure (nothing half-visible). ``on_bytes(n)``: n more bytes went through, called after each part of
    a multipart copy (so ``--bwlimit`` paces a large object part by part) or after a whole object."""
    for attempt in range(1, SOURCE_ATTEMPTS + 1):
        try:
            done, checked = _copy_version(
                src, dst, item, journal, part_size, parts_pool, on_resumed, on_restart, server_check, on_bytes
            )
            return item, done, checked
        except SourceChangedError as exc:
            if attempt == SOURCE_ATTEMPTS:
                raise SourceChangedError(
                    f"{item.key}: the source changed during each of {SOURCE_ATTEMPTS} "
                    f"attempts to copy it ({exc}); nothing was written",
                    hint="run the same command again once the source holds still",
                ) from exc
            now = src.version(item.key)
            if now is None:
                raise RetryableError(
                    f"{item.key}: the source was removed during the copy; nothing was written",
                    hint="run the same command again: it no longer lists this object",
                ) from exc
            log.info("%s: %s; copying the new version", item.key, exc)
            item = Item(item.key, now.size, now.mtime, now.etag)
            if on_restart is not None:
                on_restart(1)
    raise AssertionError("unreachable")


def _copy_version(
    src: ObjectStore,
    dst: ObjectStore,
    item: Item,
    journal: Journal,
    part_size: int | None,
    pool: ThreadPoolExecutor,
    on_resumed: Notify | None,
    on_restart: Notify | None,
    server_check: bool = False,
    on_bytes: Notify | None = None,
) -> tuple[Done, bool]:
    psize = part_size_for(item.size, part_size)
    if item.size <= psize:
        data = src.read(item.key, pin=item.version)
        if len(data) != item.size:
            raise SourceChangedError(f"{item.key}: {len(data)} bytes read, {item.size} listed")
        crc = crc64_bytes(data)
        written = dst.write(
            item.key, data, mtime=item.mtime, mtime_ns=_exact_mtime(src, item), crc=crc, server_check=server_check
        )
        if on_bytes is not None:
            on_bytes(item.size)
        return Done(
            item.size, item.mtime, crc.tagged(), written.etag, written.mtime
        ), server_check and dst.checks_bodies
    uploads = dst.multipart
    if uploads is None:
        raise UsageError(f"{dst.describe()} cannot take objects in parts; {item.key} needs {psize}-byte parts")
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            copy = _MultipartCopy(src, uploads, item, psize, journal, server_check=server_check, on_bytes=on_bytes)
            done, resumed = copy.run(pool, on_resumed)
            # Parts sent by an earlier run may have gone without Content-MD5: such an object is read back.
            return done, server_check and dst.checks_bodies and not resumed
        except UploadGoneError as exc:
            # Forget the dead id (its parts went with it) so this attempt, or the next run, starts a new one.
            journal.end_upload(item.key, None)
            if attempt == UPLOAD_ATTEMPTS:
                raise
            log.info("%s: %s; starting a new upload", item.key, exc)
            if on_restart is not None:
                on_restart(1)
    raise AssertionError("unreachable")


class _MultipartCopy:
    """One object copied in parts: an upload opened (or, on a resumable store, continued from the parts the
    journal recorded), the missing parts read and sent in parallel, their CRCs combined, then completed."""

    def __init__(
        self,
        src: ObjectStore,
        uploads: MultipartUploads,
        item: Item,
        psize: int,
        journal: Journal,
        *,
        server_check: bool,
        on_bytes: Notify | None,
    ) -> None:
        self.src, self.uploads, self.item, self.psize, self.journal = src, uploads, item, psize, journal
        self.server_check, self.on_bytes = server_check, on_bytes
        self.key = item.key
        self.resumable = uploads.resumable
        self.count = math.ceil(item.size / psize)
        self.upload_id = ""

    def run(self, pool: ThreadPoolExecutor, on_resumed: Notify | None) -> tuple[Done, bool]:
        """The copy's journal record, and whether parts sent by an earlier run were kept."""
        # The source's own full CRC, when it has one, is recorded with the new object from the start (multipart
        # metadata cannot be added later) and checked against the parts' combined CRC before completing.
        expected = _recorded_crc(self.src, self.item)
        finished = self._open(expected, on_resumed)
        parts = {n: (etag, Crc64(crc, length)) for n, (etag, crc, length) in finished.items()}
        parts.update(self._send(pool, [n for n in range(1, self.count + 1) if n not in finished]))
        total = Crc64()
        for n in range(1, self.count + 1):
            total.extend(parts[n][1])
        if expected is not None and total.tagged() != expected:
            self._drop()
            raise RetryableError(
                f"{self.key}: the parts read add up to {total.tagged()}, but the source records "
                f"{expected}; the source changed during the copy (nothing was completed)"
            )
        return self._complete(parts, total), bool(finished)

    def _open(self, expected: str | None, on_resumed: Notify | None) -> dict[int, tuple[str, int, int]]:
        """Continue the journal's upload of this very version (returning its finished parts), else start one."""
        item = self.item
        upload = self.journal.upload(self.key) if self.resumable else None
        if upload is not None and (upload.size, upload.src_mtime, upload.part_size, upload.src_etag) == (
            item.size,
            item.mtime,
            self.psize,
            item.etag,
        ):
            self.upload_id = upload.upload_id
            finished = self.journal.parts(self.key, upload.upload_id)
            if on_resumed is not None:
                on_resumed(len(finished))
            return finished
        if upload is not None:  # the source changed since: that upload cannot be continued
            self.uploads.abort(self.key, upload.upload_id)
        self.upload_id = self.uploads.create(
            self.key, item.size, mtime=item.mtime, mtime_ns=_exact_mtime(self.src, item), crc=expected
        )
        if self.resumable:
            self.journal.start_upload(self.key, Upload(self.upload_id, item.size, item.mtime, self.psize, item.etag))
        return {}

    def _send(self, pool: ThreadPoolExecutor, todo: list[int]) -> dict[int, tuple[str, Crc64]]:
        try:
            return {number: (etag, crc) for number, etag, crc in pool.map(self._part, todo)}
        except BaseException as exc:
            if not self.resumable:
                self.uploads.abort(self.key, self.upload_id)  # a local temporary file is not worth keeping
            elif isinstance(exc, SourceChangedError):
                self._drop()  # its parts are of a version that no longer exists
            raise

    def _part(self, number: int) -> tuple[int, str, Crc64]:
        offset = (number - 1) * self.psize
        length = min(self.psize, self.item.size - offset)
        data = self.src.read(self.key, offset, length, pin=self.item.version)
        if len(data) != length:
            raise RetryableError(f"{self.key}: short read of part {number} ({len(data)} of {length} bytes)")
        crc = crc64_bytes(data)
        etag = self.uploads.put_part(self.key, self.upload_id, number, offset, data, server_check=self.server_check)
        if self.resumable:
            self.journal.add_part(self.key, self.upload_id, number, etag, crc.value, crc.length)
        if self.on_bytes is not None:
            self.on_bytes(length)
        return number, etag, crc

    def _complete(self, parts: dict[int, tuple[str, Crc64]], total: Crc64) -> Done:
        item = self.item
        try:
            completed = self.uploads.complete(
                self.key,
                self.upload_id,
                [(n, parts[n][0]) for n in range(1, self.count + 1)],
                mtime=item.mtime,
                mtime_ns=_exact_mtime(self.src, item),
            )
        except BaseException:
            if not self.resumable:
                self.uploads.abort(self.key, self.upload_id)
            raise
        done = Done(item.size, item.mtime, total.tagged(), completed.etag, completed.mtime)
        if self.resumable:
            self.journal.end_upload(self.key, done)
        return done

    def _drop(self) -> None:
        """Abort the upload and forget it: a later attempt starts a new one."""
        self.uploads.abort(self.key, self.upload_id)
        if self.resumable:
            self.journal.end_upload(self.key, None)


# Reads of one large object's ranges run side by side: a single big file should not verify at the speed
# of one request at a time. Bounded so that many objects verified at once stay within memory.
RANGE_THREADS = 4
FULL_CHUNK = 8 * MiB


def _exact_mtime(src: ObjectStore, item: Item) -> int | None:
    """The source's mtime to the nanosecond, where its store keeps one and it is the listed version's: what
    the destination records, so that rclone, which compares nanoseconds, sees the copy as up to date."""
    ns = src.mtime_ns(item.key)
    return ns if ns is not None and abs(ns / 1e9 - item.mtime) < 1e-6 else None


def _recorded_crc(src: ObjectStore, item: Item) -> str | None:
    """The source's recorded full CRC, if it has one, of the pinned version only."""
    if item.etag is None:
        return src.checksum(item.key)
    head = src.head(item.key)  # the HEAD that carries the CRC must describe the version being copied
    if head is None or head.etag != item.etag or head.size != item.size:
        raise SourceChangedError(f"{item.key}: the object was overwritten or removed before the copy")
    return head.checksum


def _range_crcs(side: ObjectStore, key: str, ranges: list[tuple[int, int]], pin: Version | None = None) -> list[Crc64]:
    def one(r: tuple[int, int]) -> Crc64:
        return crc64_bytes(side.read(key, r[0], r[1], pin=pin))

    if len(ranges) <= 1:
        return [one(r) for r in ranges]
    with ThreadPoolExecutor(min(RANGE_THREADS, len(ranges)), thread_name_prefix="babel-range") as pool:
        return list(pool.map(one, ranges))


def crc_of(side: ObjectStore, key: str, size: int, pin: Version | None = None) -> Crc64:
    """The whole object's CRC64NVME, its chunks read in parallel and combined in order."""
    total = Crc64()
    ranges = [(o, min(FULL_CHUNK, size - o)) for o in range(0, size, FULL_CHUNK)]
    for crc in _range_crcs(side, key, ranges, pin):
        total.extend(crc)
    return total


def compare(
    src: ObjectStore,
    dst: ObjectStore,
    key: str,
    size: int,
    mode: str,
    *,
    samples: int,
    expected: str | None = None,
    pin: Version | None = None,
) -> tuple[str, str] | None:
    """None when the two sides agree, else (source detail, destination detail). ``sampled`` compares the
    CRCs of the same deterministic ranges on both sides; ``full`` the whole-object CRCs. Source reads are
    pinned to ``pin`` when given (``SourceChangedError`` if the source is no longer that version)."""
    if mode == "full":
        b = crc_of(dst, key, size)
        a_tag = expected or crc_of(src, key, size, pin).tagged()
        if b.length != size:
            return a_tag, f"{b.length} bytes"
        return None if a_tag == b.tagged() else (a_tag, b.tagged())
    ranges = sample_ranges(key, size, samples=samples)
    for (offset, length), a, b in zip(ranges, _range_crcs(src, key, ranges, pin), _range_crcs(dst, key, ranges)):
        if a.value != b.value or a.length != b.length:
            return (f"range {offset}+{length} {a.tagged()}", f"range {offset}+{length} {b.tagged()}")
    return None


def check_copy(src: ObjectStore, dst: ObjectStore, item: Item, done: Done, mode: str, samples: int) -> None:
    """Compare the destination with the version of the source that was copied. ``full``: the destination's
    bytes, read back, against ``done.crc``, the CRC of source bytes that all came from ``item``'s version
    (pinned reads; multipart copies also matched the source's recorded CRC of that version). ``sampled``:
    the same ranges of both sides, the source's pinned to that version, so a source changed since the copy
    is reported as changed (retryable), not as a damaged copy."""
    if mode == "none":
        return
    diff = compare(
        src,
        dst,
        item.key,
        item.size,
        mode,
        samples=samples,
        expected=done.crc if mode == "full" else None,
        pin=item.version,
    )
    if diff is not None:
        raise VerificationError(
            f"{item.key}: destination differs from the source after the copy: source {diff[0]}, destination {diff[1]}"
        )
