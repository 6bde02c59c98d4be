"""Deciding whether a source object needs copying, with no request per object in the common case.

- Missing at the destination, or another size: copy.
- By default, size + modification time. A destination that keeps mtimes (local) must show the source's (babel
  sets it). Elsewhere (S3) the journal says whether the object babel wrote there (same ETag) came from a source
  of this size and mtime; an object the journal does not know is asked about with one HEAD (its recorded
  source mtime), so a no-op re-sync of a tree babel copied sends no HEAD at all.
- ``size_only`` (rclone's ``--size-only``): equal sizes are equal, whatever the times.
- ``ignore_existing`` (rclone's ``--ignore-existing``): anything already at the destination is left alone.
- ``checksum``: the CRC64NVME of both sides (a local file's is computed; an S3 object's is the one recorded at
  upload, from the journal while the object is still the one babel wrote, else from a HEAD). Where one side
  has no recorded CRC, equal sizes count as equal.
"""

from __future__ import annotations

import threading

from lingctl.babel.journal import Done
from lingctl.babel.transfer import Item, crc_of
from lingctl.core.storage import ObjectInfo, ObjectStore

MTIME_TOLERANCE = 1e-3

# A destination object as its listing shows it (``ListingIndex.get``): (size, mtime, etag).
DstEntry = tuple[int, float, str | None]


class CopyDecision:
    """Whether each source object needs copying, given the destination's listing and the journal's records
    (``known``: destination key -> what babel wrote there). ``heads`` counts the HEAD requests it sent."""

    def __init__(
        self,
        src: ObjectStore,
        dst: ObjectStore,
        known: dict[str, Done],
        *,
        checksum: bool,
        size_only: bool = False,
        ignore_existing: bool = False,
    ) -> None:
        self.src, self.dst, self.known, self.checksum = src, dst, known, checksum
        self.size_only, self.ignore_existing = size_only, ignore_existing
        self.heads = 0
        self._lock = threading.Lock()

    def needs_copy(self, item: Item, dst: DstEntry | None) -> bool:
        if dst is None:
            return True
        if self.ignore_existing:
            return False
        if dst[0] != item.size:
            return True
        if self.size_only:
            return False
        rec = self.known.get(item.key)
        if self.checksum:
            return self._checksums_differ(item, rec, dst)
        if rec is not None and rec.size == item.size and abs(rec.src_mtime - item.mtime) < MTIME_TOLERANCE:
            if self.dst.keeps_mtime:
                return abs(dst[1] - item.mtime) >= MTIME_TOLERANCE
            # The object babel wrote is still there (same etag): no request needed to know it is current.
            if rec.dst_etag is None or dst[2] is None or _same_etag(rec.dst_etag, dst[2]):
                return False
        if self.dst.keeps_mtime:  # the listing shows the mtime babel set; other stores record it in metadata
            return abs(dst[1] - item.mtime) >= MTIME_TOLERANCE
        head = self._head(self.dst, item.key)  # written by another tool or before the journal: ask once
        return head is None or abs(head.mtime - item.mtime) >= MTIME_TOLERANCE

    def _head(self, side: ObjectStore, key: str) -> ObjectInfo | None:
        with self._lock:
            self.heads += 1
        return side.head(key)

    def _checksums_differ(self, item: Item, rec: Done | None, dst: DstEntry) -> bool:
        src_crc = self._crc(self.src, item)
        dst_crc = rec.crc if rec is not None and self._journal_matches(rec, dst) else None
        if dst_crc is None:
            dst_crc = self._crc(self.dst, item)
        if src_crc is None or dst_crc is None:
            return False  # no checksum on one side: equal sizes are all that can be compared
        return src_crc != dst_crc

    def _journal_matches(self, rec: Done, dst: DstEntry) -> bool:
        """Whether the destination object is still the one babel wrote (so the journal's CRC is its CRC)."""
        if rec.size != dst[0]:
            return False
        if self.dst.keeps_mtime:
            return abs(dst[1] - rec.src_mtime) < MTIME_TOLERANCE
        return rec.dst_etag is not None and dst[2] is not None and _same_etag(rec.dst_etag, dst[2])

    def _crc(self, side: ObjectStore, item: Item) -> str | None:
        if not side.records_checksums:  # computed from the bytes (a local file)
            return crc_of(side, item.key, item.size).tagged()
        head = self._head(side, item.key)
        return head.checksum if head is not None else None


def _same_etag(a: str, b: str) -> bool:
    return a.strip('"') == b.strip('"')
