"""The local-filesystem store: a directory whose files are objects keyed by their relative path."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lingctl.core.atomic import atomic_write, is_tmp_name
from lingctl.core.checksum import Crc64, crc64_bytes, crc64_file
from lingctl.core.errors import AccessDeniedError, NotFoundError, UsageError, os_error
from lingctl.core.storage.base import ObjectInfo, ObjectStore
from lingctl.core.storage.url import StoreURL, check_key

_COPY_CHUNK = 8 << 20


class LocalStore(ObjectStore):
    def __init__(self, url: StoreURL) -> None:
        self.url = url
        self.root = Path(url.prefix).absolute()

    def describe(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check(self) -> None:
        if not self.root.exists():
            raise NotFoundError(f"directory {self.root} does not exist")
        if not self.root.is_dir():
            raise UsageError(f"{self.root} is not a directory")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"{self.root}: permission denied")

    # -- listing ------------------------------------------------------------------------------------
    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[ObjectInfo]:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise UsageError(f"invalid prefix {prefix!r}")
        if not recursive:
            yield from self._list_dir(prefix)
            return
        # Start from the deepest directory the prefix names; _walk prunes subtrees outside the prefix.
        base, _, _ = prefix.rpartition("/")
        start = self.root / base if base else self.root
        yield from self._walk(start, f"{base}/" if base else "", prefix)

    def _entries(self, directory: Path) -> list[tuple[str, os.DirEntry, bool]]:
        """(sort name, entry, is_dir) for the objects and subdirectories of ``directory``, in key order.

        Sorting directories by name + "/" makes a depth-first walk emit keys in global byte order: "a-b"
        (0x2d) sorts before "a/x" (0x2f), just as in an S3 listing. Symlinked directories are not followed
        (no loops); symlinks to files are listed as the files they point to; broken links are skipped.
        """
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise os_error(exc, str(directory)) from exc
        keyed = []
        for entry in entries:
            if is_tmp_name(entry.name):  # an unfinished atomic write; a user's name holding the marker is listed
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    keyed.append((entry.name + "/", entry, True))
                elif entry.is_file():
                    keyed.append((entry.name, entry, False))
            except OSError:
                continue
        keyed.sort(key=lambda t: t[0])
        return keyed

    def _walk(self, directory: Path, key_prefix: str, prefix: str) -> Iterator[ObjectInfo]:
        for name, entry, is_dir in self._entries(directory):
            key = key_prefix + name
            if not (key.startswith(prefix) or (is_dir and prefix.startswith(key))):
                continue
            if is_dir:
                yield from self._walk(Path(entry.path), key, prefix)
                continue
            try:
                st = entry.stat()
            except OSError:
                continue  # vanished between scandir and stat
            yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def _list_dir(self, prefix: str) -> Iterator[ObjectInfo]:
        prefix = prefix.strip("/")
        key_prefix = f"{prefix}/" if prefix else ""
        for name, entry, is_dir in self._entries(self.root / prefix if prefix else self.root):
            try:
                st = entry.stat()
            except OSError:
                continue
            yield ObjectInfo(key=key_prefix + name.rstrip("/"), size=0 if is_dir else st.st_size, mtime=st.st_mtime,
                             is_dir=is_dir)

    # -- reading ------------------------------------------------------------------------------------
    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        if not path.is_file():
            raise NotFoundError(f"{path} is not a file")
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read() if length is None else f.read(length)
        except OSError as exc:
            raise os_error(exc, str(path)) from exc

    def download(self, key: str, path: Path) -> ObjectInfo:
        src = self._path(key)
        info = self.stat(key)
        with atomic_write(Path(path)) as (tmp, f):
            try:
                with open(src, "rb") as s:
                    shutil.copyfileobj(s, f, _COPY_CHUNK)
            except OSError as exc:
                raise os_error(exc, str(src)) from exc
        return info

    # -- writing ------------------------------------------------------------------------------------
    def write(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        path = self._path(key)
        with atomic_write(path) as (_, f):
            f.write(data)
        return self._written(key, crc64_bytes(data))

    def upload(self, key: str, path: Path) -> ObjectInfo:
        dst = self._path(key)
        crc = Crc64()
        try:
            src = open(path, "rb")
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        with src, atomic_write(dst) as (_, f):
            while block := src.read(_COPY_CHUNK):
                crc.update(block)
                f.write(block)
        return self._written(key, crc)

    def _written(self, key: str, crc: Crc64) -> ObjectInfo:
        st = self._path(key).stat()
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime, checksum=crc.tagged())

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        # As on S3, a directory exists only while it holds objects: prune the ones this left empty.
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def checksum(self, key: str) -> str:
        """Compute the CRC64NVME of a stored file (local files carry no recorded checksum)."""
        path = self._path(key)
        try:
            return crc64_file(path).tagged()
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
