"""The object-store interface, with two implementations: the local filesystem and S3.

Like rclone's ``Fs``: a store is rooted at a URL and addresses objects by '/'-separated keys relative to
that root. Listings come in key order (byte order of UTF-8, which is S3's order), so two listings can be
merged in one pass. Writes are atomic: an object appears under its final key only once complete.

Optional capabilities are attributes, never ``isinstance`` tests on a store class: ``multipart`` (uploads in
numbered parts written at offsets, as rclone's chunk writer), ``keeps_mtime`` (a listing shows the mtime a
write set), ``records_checksums`` (the store keeps each object's CRC, so asking costs no read of it) and
``local_root`` (the directory of a local store, for housekeeping such as removing stale temporary files).
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lingctl.core.storage.url import StoreURL

if TYPE_CHECKING:
    from lingctl.core.checksum import Crc64
    from lingctl.core.storage.crawl import Listed, ListStats, OnUnreadable
    from lingctl.core.storage.retry import Counters


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the store's root; for a directory entry, ends without "/"
    size: int
    mtime: float  # seconds since the epoch
    checksum: str | None = None  # "crc64nvme:<base64>" when the store knows it
    etag: str | None = None
    is_dir: bool = False  # only in non-recursive listings: a common prefix / subdirectory


@dataclass(frozen=True, slots=True)
class Version:
    """One version of an object, as listed: what every read of one copy must come from (``read(pin=)``)."""

    size: int
    mtime: float  # local st_mtime; S3 LastModified (not compared: one-second resolution in HEAD replies)
    etag: str | None = None  # S3 only


class MultipartUploads(ABC):
    """Writing one object as numbered parts at known offsets, in any order and in parallel; the object
    appears under its key only on ``complete`` (S3: CompleteMultipartUpload; local: a temporary file beside
    the target, fsync, rename). ``resumable``: an upload outlives the process (S3), so a later run can send
    only the parts that are missing, under the same id."""

    resumable: bool = False

    @abstractmethod
    def create(
        self, key: str, size: int, *, mtime: float | None = None, mtime_ns: int | None = None, crc: str | None = None
    ) -> str:
        """Start an upload of ``size`` bytes; returns its id. ``mtime`` (``mtime_ns`` when the source has it
        to the nanosecond) and ``crc`` are recorded with the object."""

    @abstractmethod
    def put_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes, *, server_check: bool = False
    ) -> str:
        """Write part ``number`` (1-based) at ``offset``; returns the part's tag for ``complete``.
        ``UploadGoneError`` when the store no longer knows the upload. ``server_check``: on a store that
        ``checks_bodies``, the server refuses a part that did not arrive as sent (a retryable error)."""

    @abstractmethod
    def complete(
        self,
        key: str,
        upload_id: str,
        parts: list[tuple[int, str]],
        *,
        mtime: float | None = None,
        mtime_ns: int | None = None,
    ) -> ObjectInfo:
        """Make the object visible; ``parts`` are (number, tag) in order. Returns its etag and store mtime."""

    @abstractmethod
    def abort(self, key: str, upload_id: str) -> None:
        """Drop the upload and its parts; aborting one that is gone is not an error."""


class ObjectStore(ABC):
    """A root directory or bucket prefix that holds objects by key."""

    url: StoreURL
    multipart: MultipartUploads | None = None
    keeps_mtime = False
    records_checksums = False
    # Whether the store can have the server check a written body against its MD5 (S3's Content-MD5: a
    # body that arrived different is refused, 400 BadDigest), so a copy needs no read-back to know the
    # bytes arrived intact.
    checks_bodies: bool = False

    @property
    def local_root(self) -> Path | None:
        return None

    @property
    def request_counters(self) -> Counters | None:
        """The requests this store sent, retries included, for a run's report (listings count theirs into
        their ``ListStats``); None for a store that sends none."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """Where this store is, for messages (never includes credentials)."""

    @abstractmethod
    def check(self) -> None:
        """Raise ``NotFoundError`` / ``AccessDeniedError`` / ``RetryableError`` unless the root is usable."""

    @abstractmethod
    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order.

        Non-recursive listings treat ``prefix`` as a directory and also yield its subdirectories
        (``is_dir=True``). A root that does not exist lists as empty, as an empty prefix does on S3.
        """

    @abstractmethod
    def walk(
        self,
        *,
        jobs: int = 16,
        stats: ListStats | None = None,
        skip_dirs: frozenset[str] = frozenset(),
        on_unreadable: OnUnreadable | None = None,
    ) -> Iterator[builtins.list[Listed]]:
        """Every object below the root, in batches, in no particular order, listed on ``jobs`` workers.

        The root is checked at once; listing starts on the first ``next()``. Directories (or common
        prefixes) named in ``skip_dirs`` are skipped at any depth. A part that cannot be read is passed to
        ``on_unreadable`` (else ``UnreadableError`` after the last batch) and the rest is listed.
        """

    def stat(self, key: str) -> ObjectInfo:
        """Size, mtime and (when known) checksum of ``key``; ``NotFoundError`` if absent."""
        from lingctl.core.errors import NotFoundError

        info = self.head(key)
        if info is None:
            raise NotFoundError(f"{key}: not found in {self.describe()}")
        return info

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """``stat`` that returns None for an absent object. The mtime is the source mtime recorded with the
        object when there is one (see ``metadata``), else the store's own."""

    @abstractmethod
    def version(self, key: str) -> Version | None:
        """The object's current version exactly as a listing shows it (None if it is gone)."""

    @abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None, *, pin: Version | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of ``key`` (to its end when ``length`` is None). With ``pin``,
        ``SourceChangedError`` unless the bytes come from that version (S3: ``If-Match`` plus ETag and total
        size checks, since some servers ignore ``If-Match``; local: size and mtime after the read).
        A server never makes a read hold more than it asked for: the range, the pinned size, else 1 GiB
        (S3; see docs/storage.md, "Bounds on every request")."""

    @abstractmethod
    def write(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        mtime: float | None = None,
        mtime_ns: int | None = None,
        crc: Crc64 | None = None,
        server_check: bool = False,
    ) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically, recording its CRC64NVME (``crc`` when the caller has it)
        and, given ``mtime``, the source's modification time (local: the file's mtime; S3: metadata).
        ``mtime_ns``, when given, is the same time to the nanosecond (what rclone compares).
        ``server_check``: on a store that ``checks_bodies``, the server refuses a body that did not arrive
        as sent; elsewhere it is ignored."""

    def mtime_ns(self, key: str) -> int | None:
        """The object's modification time in nanoseconds where the store keeps it that exactly (local
        files), else None. A float of seconds cannot carry nanoseconds: rclone compares them."""
        return None

    @abstractmethod
    def upload(self, key: str, path: Path) -> ObjectInfo:
        """Store the local file ``path`` under ``key`` atomically, recording its CRC64NVME."""

    @abstractmethod
    def download(self, key: str, path: Path) -> ObjectInfo:
        """Copy ``key`` to the local file ``path``: temporary file, fsync, rename.

        When the store knows the object's checksum the copy is verified against it before the rename
        (``VerificationError`` otherwise, and ``path`` is left as it was).
        """

    @abstractmethod
    def checksum(self, key: str) -> str | None:
        """The object's CRC64NVME as ``crc64nvme:<base64>``: computed for local files, the recorded value on S3
        (None when the object was written without one)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; removing an absent key is not an error (as on S3)."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None
