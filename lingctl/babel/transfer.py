"""Copying one object between two sides, with its CRC64NVME computed on the way, and checking it after.

Small objects go in one request. Larger ones are cut into parts whose size adapts to the object (at most
``MAX_PARTS`` parts), read and written in parallel; the part CRCs are combined into the full-object CRC
(CRC combination, so parts need not be hashed in order). On an S3 destination the journal records each
finished part, so a re-run continues a half-done upload instead of starting it again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lingctl.babel.journal import Done, Journal, Upload
from lingctl.babel.sampling import sample_ranges
from lingctl.babel.sides import Side
from lingctl.core.checksum import Crc64, crc64_bytes
from lingctl.core.errors import RetryableError, VerificationError

MiB = 1 << 20
MIN_PART = 8 * MiB
MAX_PARTS = 1000  # S3 allows 10,000; fewer, larger parts keep per-request overhead low


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


def copy_object(src: Side, dst: Side, item: Item, *, journal: Journal, part_size: int | None,
                parts_pool: ThreadPoolExecutor, on_resumed: Callable[[int], None] | None = None) -> Done:
    """Copy ``item``; returns what the journal records for it. Raises on failure (nothing half-visible)."""
    psize = part_size_for(item.size, part_size)
    if item.size <= psize:
        data = src.read(item.key)
        if len(data) != item.size:
            raise RetryableError(f"{item.key}: source changed during the copy ({len(data)} bytes, listed {item.size})")
        crc = crc64_bytes(data)
        etag, dst_mtime = dst.put(item.key, data, crc, item.mtime)
        return Done(item.size, item.mtime, crc.tagged(), etag, dst_mtime)
    return _copy_multipart(src, dst, item, psize, journal, parts_pool, on_resumed)


def _copy_multipart(src: Side, dst: Side, item: Item, psize: int, journal: Journal,
                    pool: ThreadPoolExecutor, on_resumed: Callable[[int], None] | None) -> Done:
    key = item.key
    count = math.ceil(item.size / psize)
    # The source's own full CRC, when it has one, is recorded with the new object from the start (multipart
    # metadata cannot be added later) and checked against the parts' combined CRC before completing.
    expected = src.crc_tag(key)
    upload = journal.upload(key) if dst.resumable_uploads else None
    finished: dict[int, tuple[str, int, int]] = {}
    if upload is not None and (upload.size, upload.src_mtime, upload.part_size) == (item.size, item.mtime, psize):
        finished = journal.parts(key, upload.upload_id)
        upload_id = upload.upload_id
        if on_resumed is not None:
            on_resumed(len(finished))
    else:
        if upload is not None:  # the source changed since: that upload cannot be continued
            dst.abort(key, upload.upload_id)
        upload_id = dst.create_upload(key, item.size, item.mtime, expected)
        if dst.resumable_uploads:
            journal.start_upload(key, Upload(upload_id, item.size, item.mtime, psize))

    def one(number: int) -> tuple[int, str, Crc64]:
        offset = (number - 1) * psize
        length = min(psize, item.size - offset)
        data = src.read(key, offset, length)
        if len(data) != length:
            raise RetryableError(f"{key}: short read of part {number} ({len(data)} of {length} bytes)")
        crc = crc64_bytes(data)
        etag = dst.put_part(key, upload_id, number, offset, data)
        if dst.resumable_uploads:
            journal.add_part(key, upload_id, number, etag, crc.value, crc.length)
        return number, etag, crc

    todo = [n for n in range(1, count + 1) if n not in finished]
    results = {n: (e, Crc64(c, ln)) for n, (e, c, ln) in finished.items()}
    try:
        for number, etag, crc in pool.map(one, todo):
            results[number] = (etag, crc)
    except BaseException:
        if not dst.resumable_uploads:
            dst.abort(key, upload_id)  # a local temporary file is not worth keeping
        raise
    total = Crc64()
    for n in range(1, count + 1):
        total.extend(results[n][1])
    if expected is not None and total.tagged() != expected:
        dst.abort(key, upload_id)
        if dst.resumable_uploads:
            journal.end_upload(key, None)
        raise RetryableError(f"{key}: the parts read add up to {total.tagged()}, but the source records "
                             f"{expected}; the source changed during the copy (nothing was completed)")
    etag, dst_mtime = dst.complete(key, upload_id, [(n, results[n][0]) for n in range(1, count + 1)], item.mtime)
    done = Done(item.size, item.mtime, total.tagged(), etag, dst_mtime)
    if dst.resumable_uploads:
        journal.end_upload(key, done)
    return done


# Reads of one large object's ranges run side by side: a single big file should not verify at the speed
# of one request at a time. Bounded so that many objects verified at once stay within memory.
RANGE_THREADS = 4
FULL_CHUNK = 8 * MiB


def _range_crcs(side: Side, key: str, ranges: list[tuple[int, int]]) -> list[Crc64]:
    def one(r: tuple[int, int]) -> Crc64:
        return crc64_bytes(side.read(key, r[0], r[1]))

    if len(ranges) <= 1:
        return [one(r) for r in ranges]
    with ThreadPoolExecutor(min(RANGE_THREADS, len(ranges)), thread_name_prefix="babel-range") as pool:
        return list(pool.map(one, ranges))


def crc_of(side: Side, key: str, size: int) -> Crc64:
    """The whole object's CRC64NVME, its chunks read in parallel and combined in order."""
    total = Crc64()
    ranges = [(o, min(FULL_CHUNK, size - o)) for o in range(0, size, FULL_CHUNK)]
    for crc in _range_crcs(side, key, ranges):
        total.extend(crc)
    return total


def compare(src: Side, dst: Side, key: str, size: int, mode: str, *, samples: int,
            expected: str | None = None) -> tuple[str, str] | None:
    """None when the two sides agree, else (source detail, destination detail). ``sampled`` compares the
    CRCs of the same deterministic ranges on both sides; ``full`` the whole-object CRCs."""
    if mode == "full":
        b = crc_of(dst, key, size)
        a_tag = expected or crc_of(src, key, size).tagged()
        if b.length != size:
            return a_tag, f"{b.length} bytes"
        return None if a_tag == b.tagged() else (a_tag, b.tagged())
    ranges = sample_ranges(key, size, samples=samples)
    for (offset, length), a, b in zip(ranges, _range_crcs(src, key, ranges), _range_crcs(dst, key, ranges)):
        if a.value != b.value or a.length != b.length:
            return (f"range {offset}+{length} {a.tagged()}", f"range {offset}+{length} {b.tagged()}")
    return None


def check_copy(src: Side, dst: Side, item: Item, done: Done, mode: str, samples: int) -> None:
    if mode == "none":
        return
    diff = compare(src, dst, item.key, item.size, mode, samples=samples, expected=done.crc if mode == "full" else None)
    if diff is not None:
        raise VerificationError(f"{item.key}: destination differs from the source after the copy: "
                                f"source {diff[0]}, destination {diff[1]}")
