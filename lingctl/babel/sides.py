"""The two ends of a transfer: a local directory or an S3 prefix, behind one small interface.

Both sides read byte ranges and write objects either whole or as numbered parts at offsets that become
visible under their final key only on ``complete`` (S3: CompleteMultipartUpload; local: a temporary file
beside the target, fsync, rename). S3 calls go through the shared AIMD gate and retrier.

A read may be pinned to a ``Version`` of the source object (its size, mtime and ETag as listed): an S3 GET
then carries ``If-Match`` and every response's ETag and total size are compared with the pin as well (some
S3-compatible servers ignore ``If-Match``); a local read compares the open file's size and mtime. A read
that finds another version raises ``SourceChangedError``, so a copy never mixes bytes of two versions.
"""

from __future__ import annotations

import dataclasses
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.babel.throttle import Aimd, RestartError, Retrier
from lingctl.core.atomic import fsync_dir, tmp_path
from lingctl.core.checksum import Crc64, crc64_file, tag_from_b64
from lingctl.core.errors import LingctlError, NotFoundError, os_error
from lingctl.core.names import join_under
from lingctl.core.storage import S3Options, StoreURL
from lingctl.core.storage.s3 import CHECKSUM_META, make_client, translate

MTIME_META = "lingctl-mtime"  # the source's modification time, as rclone keeps it in "mtime" metadata


@dataclass(slots=True)
class Head:
    size: int
    mtime: float  # the source mtime recorded with the object, else the store's own
    crc: str | None
    etag: str | None


@dataclass(frozen=True, slots=True)
class Version:
    """One version of a source object, as listed: what every read of one copy must come from."""

    size: int
    mtime: float  # local st_mtime; S3 LastModified (not compared: one-second resolution)
    etag: str | None = None  # S3 only


class SourceChangedError(RestartError):
    """The source object is no longer the version the copy started from (overwritten, or removed)."""


class UploadGoneError(RestartError):
    """The server no longer knows the multipart upload (restarted, or a lifecycle rule aborted it)."""


class Side(ABC):
    url: StoreURL

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def check(self) -> None:
        """Raise NotFoundError / AccessDeniedError / RetryableError unless the root is usable."""

    @abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None, *, pin: Version | None = None) -> bytes:
        """Bytes of ``key``; with ``pin``, ``SourceChangedError`` unless they come from that version."""

    @abstractmethod
    def head(self, key: str) -> Head | None: ...

    @abstractmethod
    def version(self, key: str) -> Version | None:
        """The object's current version exactly as a listing shows it (None if it is gone)."""

    @abstractmethod
    def crc_tag(self, key: str) -> str | None:
        """The object's full CRC64NVME (``crc64nvme:<base64>``) if this side can tell it, else None."""

    @abstractmethod
    def put(self, key: str, data: bytes, crc: Crc64, mtime: float) -> tuple[str | None, float]:
        """Write a whole object; returns (etag, destination mtime)."""

    @abstractmethod
    def create_upload(self, key: str, size: int, mtime: float, crc: str | None) -> str: ...

    @abstractmethod
    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str: ...

    @abstractmethod
    def complete(self, key: str, upload_id: str, parts: list[tuple[int, str]], mtime: float
                 ) -> tuple[str | None, float]: ...

    @abstractmethod
    def abort(self, key: str, upload_id: str) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    # Whether a half-done upload survives the process (S3 multipart) and can be continued.
    resumable_uploads = False


class LocalSide(Side):
    def __init__(self, url: StoreURL) -> None:
        self.url = url
        self.root = url.path

    def describe(self) -> str:
        return str(self.root)

    def check(self) -> None:
        if not self.root.is_dir():
            raise NotFoundError(f"directory {self.root} does not exist")

    def path(self, key: str) -> Path:
        """The file for ``key``; keys with '..', absolute, empty or control-character segments, or names no
        file system takes, are refused (``UnsafeNameError``, exit 4): nothing is written outside the root."""
        return join_under(self.root, key, what=f"refusing key for {self.root}")

    def read(self, key: str, offset: int = 0, length: int | None = None, *, pin: Version | None = None) -> bytes:
        path = self.path(key)
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
                        raise SourceChangedError(f"{path}: the file changed during the copy (size {pin.size} -> "
                                                 f"{st.st_size}, mtime {pin.mtime} -> {st.st_mtime})")
                return data
        except FileNotFoundError as exc:
            if pin is not None:
                raise SourceChangedError(f"{path}: the file was removed during the copy") from exc
            raise os_error(exc, str(path)) from exc
        except OSError as exc:
            raise os_error(exc, str(path)) from exc

    def head(self, key: str) -> Head | None:
        try:
            st = self.path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise os_error(exc, str(self.path(key))) from exc
        return Head(st.st_size, st.st_mtime, None, None)

    def version(self, key: str) -> Version | None:
        head = self.head(key)
        return Version(head.size, head.mtime) if head is not None else None

    def crc_tag(self, key: str) -> str | None:
        path = self.path(key)
        try:
            return crc64_file(path).tagged()  # ~8 GB/s: cheap next to sending the bytes anywhere
        except OSError as exc:
            raise os_error(exc, str(path)) from exc

    def _finish(self, tmp: Path, target: Path, mtime: float) -> float:
        os.utime(tmp, (mtime, mtime))  # size + mtime equal to the source is how a re-run skips it
        os.replace(tmp, target)
        fsync_dir(target.parent)
        return mtime

    def _tmp(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        return tmp_path(target)  # names its host and pid: a later run removes it if this process dies

    def put(self, key: str, data: bytes, crc: Crc64, mtime: float) -> tuple[str | None, float]:
        target = self.path(key)
        tmp: Path | None = None
        try:
            tmp = self._tmp(target)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return None, self._finish(tmp, target, mtime)
        except OSError as exc:
            if tmp is not None:
                tmp.unlink(missing_ok=True)  # a full disk or a size limit must not leave a partial file
            raise os_error(exc, str(target)) from exc

    def create_upload(self, key: str, size: int, mtime: float, crc: str | None) -> str:
        target = self.path(key)
        tmp: Path | None = None
        try:
            tmp = self._tmp(target)
            with open(tmp, "xb") as f:
                f.truncate(size)
        except OSError as exc:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise os_error(exc, str(target)) from exc
        return tmp.name

    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str:
        tmp = self.path(key).parent / upload_id
        try:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise os_error(exc, str(tmp)) from exc
        return str(number)

    def complete(self, key: str, upload_id: str, parts: list[tuple[int, str]], mtime: float
                 ) -> tuple[str | None, float]:
        target = self.path(key)
        tmp = target.parent / upload_id
        try:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return None, self._finish(tmp, target, mtime)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise os_error(exc, str(target)) from exc

    def abort(self, key: str, upload_id: str) -> None:
        (self.path(key).parent / upload_id).unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise os_error(exc, str(self.path(key))) from exc


class S3Side(Side):
    resumable_uploads = True

    def __init__(self, url: StoreURL, options: S3Options, gate: Aimd) -> None:
        self.url = url
        # Our retrier sees every failure (to adapt concurrency), so botocore's own retries are off.
        self.options = options
        self.client = make_client(dataclasses.replace(options, max_attempts=1))
        # botocore sends "Expect: 100-continue" with every PUT body and waits for the server's go-ahead: one
        # extra round trip per object, which dominates copying many small files. Our bodies are in memory
        # and a rejected PUT is simply retried, so the handshake buys nothing here.
        import botocore.handlers

        self.client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
        self.bucket = url.bucket
        self.root = f"{url.prefix}/" if url.prefix else ""
        self.endpoint = options.resolved_endpoint() or ""
        self.retrier = Retrier(gate, lambda exc, what, n: translate(exc, what, self.endpoint, n),
                               attempts=options.max_attempts)

    def describe(self) -> str:
        return f"{self.url} at {self.endpoint or 'AWS S3'}"

    def _k(self, key: str) -> str:
        return self.root + key

    def _call(self, key: str, fn: Any, **kwargs: Any) -> Any:
        return self.retrier.call(f"{self.bucket}/{self._k(key)}", fn, Bucket=self.bucket, **kwargs)

    def check(self) -> None:
        self.retrier.call(self.bucket, self.client.head_bucket, Bucket=self.bucket)

    def read(self, key: str, offset: int = 0, length: int | None = None, *, pin: Version | None = None) -> bytes:
        kwargs: dict[str, Any] = {"Key": self._k(key)}
        if length == 0:
            return b""
        if offset or length is not None:
            kwargs["Range"] = f"bytes={offset}-{'' if length is None else offset + length - 1}"
        if pin is not None and pin.etag:
            kwargs["IfMatch"] = f'"{pin.etag}"'
        what = f"{self.bucket}/{self._k(key)}"

        def get(**kw: Any) -> bytes:
            import botocore.exceptions

            try:
                resp = self.client.get_object(**kw)
            except botocore.exceptions.ClientError as exc:
                if pin is not None and _status(exc) in (404, 412):
                    change = "overwritten" if _status(exc) == 412 else "removed"
                    raise SourceChangedError(f"{what}: the object was {change} during the copy") from exc
                raise
            if pin is not None:
                _check_version(what, pin, resp)
            return resp["Body"].read()  # the body read is retried with the request

        return self._call(key, get, **kwargs)

    def head(self, key: str) -> Head | None:
        try:
            h = self._call(key, self.client.head_object, Key=self._k(key))
        except NotFoundError:
            return None
        except LingctlError as exc:
            if "404" in str(exc) or "Not Found" in str(exc):
                return None
            raise
        meta = {k.lower(): v for k, v in h.get("Metadata", {}).items()}
        mtime = h["LastModified"].timestamp()
        try:
            mtime = float(meta.get(MTIME_META, mtime))
        except ValueError:
            pass
        crc = meta.get(CHECKSUM_META)
        return Head(h["ContentLength"], mtime, tag_from_b64(crc) if crc else None,
                    h.get("ETag", "").strip('"') or None)

    def version(self, key: str) -> Version | None:
        # A one-key listing, not a HEAD: listings carry LastModified to the millisecond, HEAD to the second,
        # and the copy records the source mtime that the next run's listing will compare.
        full = self._k(key)
        resp = self.retrier.call(f"{self.bucket}/{full}", self.client.list_objects_v2, Bucket=self.bucket,
                                 Prefix=full, MaxKeys=1)
        for o in resp.get("Contents", ()):
            if o["Key"] == full:
                return Version(o["Size"], o["LastModified"].timestamp(), o.get("ETag", "").strip('"') or None)
        return None

    def crc_tag(self, key: str) -> str | None:
        head = self.head(key)
        return head.crc if head is not None else None

    def _meta(self, mtime: float, crc: str | None) -> dict[str, str]:
        meta = {MTIME_META: repr(float(mtime))}
        if crc is not None:
            meta[CHECKSUM_META] = crc.split(":", 1)[1]
        return meta

    def put(self, key: str, data: bytes, crc: Crc64, mtime: float) -> tuple[str | None, float]:
        resp = self._call(key, self.client.put_object, Key=self._k(key), Body=data, ChecksumCRC64NVME=crc.b64(),
                          Metadata=self._meta(mtime, crc.tagged()))
        return resp.get("ETag", "").strip('"') or None, time.time()

    def create_upload(self, key: str, size: int, mtime: float, crc: str | None) -> str:
        resp = self._call(key, self.client.create_multipart_upload, Key=self._k(key), Metadata=self._meta(mtime, crc))
        return resp["UploadId"]

    def _upload_call(self, key: str, upload_id: str, fn: Any, **kwargs: Any) -> Any:
        """``fn`` on the upload ``upload_id``, with NoSuchUpload (or a bare 404, or parts the server no longer
        has) raised as ``UploadGoneError``: resending the request cannot help, a new upload can."""
        import botocore.exceptions

        def call(**kw: Any) -> Any:
            try:
                return fn(**kw)
            except botocore.exceptions.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in ("NoSuchUpload", "InvalidPart") or _status(exc) == 404:
                    raise UploadGoneError(f"{self.bucket}/{self._k(key)}: the server no longer knows multipart "
                                          f"upload {upload_id[:16]}... ({code or 404})") from exc
                raise

        return self._call(key, call, Key=self._k(key), UploadId=upload_id, **kwargs)

    def put_part(self, key: str, upload_id: str, number: int, offset: int, data: bytes) -> str:
        resp = self._upload_call(key, upload_id, self.client.upload_part, PartNumber=number, Body=data)
        return resp["ETag"]

    def complete(self, key: str, upload_id: str, parts: list[tuple[int, str]], mtime: float
                 ) -> tuple[str | None, float]:
        resp = self._upload_call(key, upload_id, self.client.complete_multipart_upload,
                                 MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in parts]})
        # Some servers list a multipart object under another ETag than CompleteMultipartUpload returned
        # (rclone's lists the MD5 of the stored file). One HEAD per large object records the one that
        # listings show, so re-syncs recognise the object without a HEAD each time.
        head = self.head(key)
        etag = head.etag if head is not None else resp.get("ETag", "").strip('"') or None
        return etag, time.time()

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self._call(key, self.client.abort_multipart_upload, Key=self._k(key), UploadId=upload_id)
        except LingctlError:
            pass  # an upload that is already gone needs no abort

    def delete(self, key: str) -> None:
        self._call(key, self.client.delete_object, Key=self._k(key))


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _check_version(what: str, pin: Version, resp: dict[str, Any]) -> None:
    """Raise ``SourceChangedError`` unless a GET response is of the pinned version: same ETag (when pinned)
    and the same total size (Content-Range ``bytes a-b/TOTAL``, or the length of a whole-object GET)."""
    etag = (resp.get("ETag") or "").strip('"') or None
    if pin.etag and etag and etag != pin.etag:
        raise SourceChangedError(f"{what}: the object was overwritten during the copy (ETag {pin.etag} -> {etag})")
    content_range = resp.get("ContentRange") or ""
    total = content_range.rpartition("/")[2] if content_range else str(resp.get("ContentLength", ""))
    if total.isdigit() and int(total) != pin.size:
        raise SourceChangedError(f"{what}: the object was overwritten during the copy (size {pin.size} -> {total})")


def open_side(url: StoreURL, s3: S3Options, gate: Aimd) -> Side:
    return S3Side(url, s3, gate) if url.is_s3 else LocalSide(url)
