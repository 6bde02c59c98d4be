"""The local-filesystem store: a directory whose files are objects keyed by their relative path.

Files carry the source's modification time (``write(mtime=)``), which is how a re-sync recognises them;
multipart uploads are a temporary file beside the target, written at offsets and renamed when complete.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from lingctl.core.atomic import atomic_write, commit_tmp, create_tmp, is_tmp_name
from lingctl.core.checksum import Crc64, crc64_bytes, crc64_file
from lingctl.core.errors import AccessDeniedError, LingctlError, NotFoundError, UsageError, os_error
from lingctl.core.names import UnsafeNameError, join_under
from lingctl.core.storage.base import MultipartUploads, ObjectInfo, ObjectStore, Version
from lingctl.core.storage.crawl import Crawl, Listed, ListStats, OnUnreadable
from lingctl.core.storage.retry import SourceChangedError
from lingctl.core.storage.url import InvalidKeyError, StoreURL

_COPY_CHUNK = 8 << 20


class LocalStore(ObjectStore):
    keeps_mtime = True

    def __init__(self, url: StoreURL) -> None:
        self.url = url
        self.root = Path(url.prefix).absolute()
        self.multipart = _LocalUploads(self)

    @property
    def local_root(self) -> Path:
        return self.root

    def describe(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        """The file for ``key``. Keys with '..', absolute, empty or control-character segments, or names no
        file system takes, are refused (``InvalidKeyError``): nothing is written outside the root."""
        try:
            return join_under(self.root, key, what=f"refusing key for {self.root}")
        except UnsafeNameError as exc:
            raise InvalidKeyError(exc.message, hint="keys are relative names like 'dir/file'") from None

    path = _path

    def check(self) -> None:
        if not self.root.exists():
            raise NotFoundError(f"directory {self.root} does not exist")
        if not self.root.is_dir():
            raise UsageError(f"{self.root} is not a directory")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"{self.root}: permission denied")

    # -- listing ------------------------------------------------------------------------------------
    def walk(
        self,
        *,
        jobs: int = 16,
        stats: ListStats | None = None,
        skip_dirs: frozenset[str] = frozenset(),
        on_unreadable: OnUnreadable | None = None,
    ) -> Iterator[builtins.list[Listed]]:
        from lingctl.core.storage.local_listing import LocalLister

        lister = LocalLister(str(self.url.path), skip_dirs)
        return Crawl(jobs, stats or ListStats(), lister.scan, on_unreadable=on_unreadable).run((lister.root, ""))

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

    def _entries(self, directory: Path) -> builtins.list[tuple[str, os.DirEntry, bool]]:
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
            yield ObjectInfo(
                key=key_prefix + name.rstrip("/"), size=0 if is_dir else st.st_size, mtime=st.st_mtime, is_dir=is_dir
            )

    # -- reading ------------------------------------------------------------------------------------
    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        if not path.is_file():
            return None
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def mtime_ns(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_mtime_ns
        except OSError:
            return None

    def version(self, key: str) -> Version | None:
        info = self.head(key)
        return Version(info.size, info.mtime) if info is not None else None

    def read(self, key: str, offset: int = 0, length: int | None = None, *, pin: Version | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if length is None:
                    f.seek(offset)
                    data = f.read()
                else:
                    data = os.pread(f.fileno(), length, offset)
                if pin is not None:
                    # Checked after the read: a write that raced it has changed the size or mtime by now.
                    st = os.fstat(f.fileno())
                    if st.st_size != pin.size or st.st_mtime != pin.mtime:
                        raise SourceChangedError(
                            f"{path}: the file changed during the copy (size {pin.size} -> "
                            f"{st.st_size}, mtime {pin.mtime} -> {st.st_mtime})"
                        )
                return data
        except FileNotFoundError as exc:
            if pin is not None:
                raise SourceChangedError(f"{path}: the file was removed during the copy") from exc
            raise os_error(exc, str(path)) from exc
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

    def checksum(self, key: str) -> str:
        """Compute the CRC64NVME of a stored file (local files carry no recorded checksum)."""
        path = self._path(key)
        try:
            return crc64_file(path).tagged()  # ~8 GB/s: cheap next to sending the bytes anywhere
        except OSError as exc:
            raise os_error(exc, str(path)) from exc

    # -- writing ------------------------------------------------------------------------------------
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
        path = self._path(key)
        with atomic_write(path, mtime=mtime, mtime_ns=mtime_ns) as (_, f):
            f.write(data)
        return self._written(key, crc or crc64_bytes(data))

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


class _LocalUploads(MultipartUploads):
    """Multipart uploads into a local directory: the upload id is the name of a temporary file beside the
    target (``core.atomic``'s naming, so a run that dies leaves a file a later run can tell is stale), its
    parts are written at their offsets, and ``complete`` renames it into place. Not resumable: a temporary
    file of a process that died is removed, not continued."""

    resumable = False

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def create(
        self, key: str, size: int, *, mtime: float | None = None, mtime_ns: int | None = None, crc: str | None = None
    ) -> str:
        target = self.store.path(key)
        tmp, fd = create_tmp(target)
        try:
            _reserve(fd, size)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise os_error(exc, str(target)) from exc
        finally:
            os.close(fd)
        return tmp.name

    def _tmp(self, key: str, upload_id: str) -> Path:
        if "/" in upload_id or not is_tmp_name(upload_id):
            raise UsageError(f"{upload_id!r} is not an upload of {self.store.root}")
        return self.store.path(key).parent / upload_id

    def put_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes, *, server_check: bool = False
    ) -> str:
        tmp = self._tmp(key, upload_id)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                _pwrite_all(fd, data, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise os_error(exc, str(tmp)) from exc
        # The tag records where the part went and how long it was, so ``complete`` can show that the parts
        # cover the file exactly: a part that was never written leaves a hole of zeros, not an error.
        return f"{number}:{offset}:{len(data)}"

    def complete(
        self,
        key: str,
        upload_id: str,
        parts: list[tuple[int, str]],
        *,
        mtime: float | None = None,
        mtime_ns: int | None = None,
    ) -> ObjectInfo:
        target = self.store.path(key)
        tmp = self._tmp(key, upload_id)
        try:
            _check_parts(tmp, parts)
            commit_tmp(tmp, target, mtime=mtime, mtime_ns=mtime_ns)
            st = target.stat()
        except IncompleteUploadError:
            tmp.unlink(missing_ok=True)
            raise
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise os_error(exc, str(target)) from exc
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def abort(self, key: str, upload_id: str) -> None:
        self._tmp(key, upload_id).unlink(missing_ok=True)


class IncompleteUploadError(LingctlError):
    """The parts given to ``complete`` do not cover the temporary file exactly: it is not renamed into place."""


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``. ``pwrite`` may write less than asked (a disk filling up, a
    file-size limit, a signal); the rest is written again until the call fails with the reason (ENOSPC,
    EFBIG), which is raised. A short count taken as done leaves a hole of zeros in the file."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # no progress and no error: a full disk that does not say so
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        offset += n


def _reserve(fd: int, size: int) -> None:
    """Give the temporary file its final size, with its blocks allocated where the file system can
    (``fallocate``): a disk too small for the object fails here, before any part is fetched, as rclone's
    preallocation does. Elsewhere the file is extended sparsely and a full disk shows at the write."""
    if size > 0 and _fallocate is not None:
        if _fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(size)) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(err, os.strerror(err))
        # EOPNOTSUPP and the like: the file system cannot reserve; fall through to a sparse file.
    os.ftruncate(fd, size)


def _load_fallocate() -> Callable[..., int] | None:
    """Linux's ``fallocate(2)`` (no emulation, unlike ``posix_fallocate``, which writes zeros block by block
    on file systems that cannot reserve)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


_fallocate = _load_fallocate()


def _check_parts(tmp: Path, parts: builtins.list[tuple[int, str]]) -> None:
    """Refuse to complete unless the parts, in order, were written back to back from offset 0 to the end of
    the temporary file (its size is the object's, set by ``create``)."""
    size = os.stat(tmp, follow_symlinks=False).st_size
    end = 0
    for number, tag in parts:
        try:
            tagged, offset, length = (int(x) for x in tag.split(":"))
        except ValueError:
            raise IncompleteUploadError(f"{tmp}: part {number} has tag {tag!r}, not one this store gave") from None
        if tagged != number or offset != end:
            raise IncompleteUploadError(
                f"{tmp}: part {number} starts at byte {offset}, but the parts before it end at {end}"
            )
        end += length
    if end != size:
        raise IncompleteUploadError(f"{tmp}: the parts cover {end} of {size} bytes; the file is not complete")
