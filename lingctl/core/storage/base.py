"""The object-store interface, with two implementations: the local filesystem and S3.

Like rclone's ``Fs``: a store is rooted at a URL and addresses objects by '/'-separated keys relative to
that root. Listings come in key order (byte order of UTF-8, which is S3's order), so two listings can be
merged in one pass. Writes are atomic: an object appears under its final key only once complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.storage.url import StoreURL


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the store's root; for a directory entry, ends without "/"
    size: int
    mtime: float  # seconds since the epoch
    checksum: str | None = None  # "crc64nvme:<base64>" when the store knows it
    etag: str | None = None
    is_dir: bool = False  # only in non-recursive listings: a common prefix / subdirectory


class ObjectStore(ABC):
    """A root directory or bucket prefix that holds objects by key."""

    url: StoreURL

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
    def stat(self, key: str) -> ObjectInfo:
        """Size, mtime and (when known) checksum of ``key``; ``NotFoundError`` if absent."""

    @abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of ``key`` (to its end when ``length`` is None)."""

    @abstractmethod
    def write(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically, recording its CRC64NVME."""

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
        from lingctl.core.errors import NotFoundError

        try:
            self.stat(key)
        except NotFoundError:
            return False
        return True
