"""The S3 store (AWS S3 or any S3-compatible server), through boto3, imported only when used.

Every request goes through one ``retry.Retrier`` and its AIMD gate (botocore's own retries are off, so the
retrier sees every failure and can lower concurrency on throttling). Recursive listings are the parallel
lister of ``listing``, its pages sent by the signed client on the same gate and retry policy; everything
else is a boto3 call. What is recorded with each object (the
CRC64NVME, the source mtime in lingctl's and rclone's keys) is written and parsed by ``metadata``.

The per-object requests that a tree of files repeats thousands of times (GET, HEAD, PUT, DELETE, and the
multipart requests: create, part, complete, abort) go through ``signed_http``'s client instead of boto3's:
the same SigV4 signing and the same errors (botocore's exception types), at about a tenth of boto3's CPU per
request. Non-recursive listings and streaming downloads stay on boto3.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.checksum import Crc64, crc64_bytes, crc64_file
from lingctl.core.errors import (
    LingctlError,
    NotFoundError,
    RetryableError,
    UsageError,
    VerificationError,
    os_error,
)
from lingctl.core.storage.base import MultipartUploads, ObjectInfo, ObjectStore, Version
from lingctl.core.storage.crawl import Listed, ListStats, OnUnreadable
from lingctl.core.storage.metadata import CHECKSUM_META, object_metadata, parse_reply, unquoted_etag
from lingctl.core.storage.retry import (
    Aimd,
    Counters,
    Retrier,
    SourceChangedError,
    UploadGoneError,
    response_code,
    response_status,
)
from lingctl.core.storage.s3.client import S3Options, make_client, repeated_token_error, translate
from lingctl.core.storage.url import StoreURL, check_object_key

__all__ = ["CHECKSUM_META", "S3Options", "S3Store", "list_buckets", "make_client", "translate"]

log = logging.getLogger(__name__)

_MiB = 1 << 20
# Requests in flight per store when no gate is shared with it (babel passes one gate for all its stores).
_DEFAULT_CONCURRENCY = 64


def list_buckets(options: S3Options, *, unsigned: bool = False) -> list[str]:
    """The names of the buckets the credentials can see (one ListBuckets, through the retry policy)."""
    from lingctl.core.storage.url import redact_url

    endpoint = options.resolved_endpoint()
    shown = redact_url(endpoint) if endpoint else ""
    client = make_client(options, unsigned=unsigned, attempts=1)
    retrier = Retrier(Aimd(1), lambda exc, what, n: translate(exc, what, shown, n), attempts=options.max_attempts)
    return [b["Name"] for b in retrier.call("ListBuckets", client.list_buckets).get("Buckets", [])]


class S3Store(ObjectStore):
    records_checksums = True
    checks_bodies = True

    def __init__(self, url: StoreURL, options: S3Options | None = None, *, gate: Aimd | None = None) -> None:
        if not url.is_s3:
            raise ValueError(f"not an s3:// URL: {url}")
        self.url = url
        self.options = options or S3Options()
        self.bucket = url.bucket
        self._root = f"{url.prefix}/" if url.prefix else ""
        self.endpoint = self.options.resolved_endpoint() or ""
        self.gate = gate or Aimd(_DEFAULT_CONCURRENCY)
        self.retrier = Retrier(
            self.gate, lambda exc, what, n: translate(exc, what, self.endpoint, n), attempts=self.options.max_attempts
        )
        self.multipart: _S3Uploads = _S3Uploads(self)  # always: every S3 store has multipart uploads
        self._client: Any = None
        self._http: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        # Created on first use (boto3 import and credential resolution cost ~0.3 s); clients are thread-safe.
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = make_client(self.options, attempts=1)
                    # botocore sends "Expect: 100-continue" with every PUT body and waits for the server's
                    # go-ahead: one extra round trip per object, which dominates copying many small files.
                    # Bodies are in memory and a rejected PUT is simply retried, so it buys nothing here.
                    import botocore.handlers

                    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
                    self._client = client
        return self._client

    @property
    def http(self) -> Any:
        """The signed HTTP client for per-object requests (created on first use; thread-safe)."""
        if self._http is None:
            with self._lock:
                if self._http is None:
                    from lingctl.core.storage.s3.signed_http import SignedS3Client

                    self._http = SignedS3Client(
                        self.options, self.bucket, max_connections=max(16, int(self.gate.maximum))
                    )
        return self._http

    @property
    def request_counters(self) -> Counters:
        return self.retrier.counters

    def describe(self) -> str:
        return f"{self.url} at {self.endpoint or 'AWS S3'}"

    def _key(self, key: str) -> str:
        return self._root + check_object_key(key)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        return self.retrier.call(what, fn, **kwargs)

    def _obj(self, key: str, method: str, **kwargs: Any) -> Any:
        """``method`` of the client on object ``key``, through the retrier."""
        full = self._key(key)
        return self.retrier.call(
            f"{self.bucket}/{full}", getattr(self.client, method), Bucket=self.bucket, Key=full, **kwargs
        )

    def check(self) -> None:
        # Through the signed client: a command that only lists and copies never builds a boto3 client
        # (importing boto3 and loading its service model cost about 0.4 s of CPU per process).
        self._call(self.bucket, self.http.head_bucket)

    # -- listing ------------------------------------------------------------------------------------
    def walk(
        self,
        *,
        jobs: int = 16,
        stats: ListStats | None = None,
        skip_dirs: frozenset[str] = frozenset(),
        on_unreadable: OnUnreadable | None = None,
        within: str = "",
    ) -> Iterator[list[Listed]]:
        from lingctl.core.storage.s3.listing import Range, S3Lister

        # The signed client (credentials resolved here, at once): lingctl's own SigV4 and keep-alive pool,
        # without importing boto3 or botocore's signer, which a process that only lists would pay for.
        lister = S3Lister(self.url, self.http, self.retrier, skip_dirs, within=within, endpoint=self.endpoint)
        start = within.rpartition("/")[0]
        first = Range(lister.prefix + (start + "/" if start else ""))
        return lister.walk(first, jobs, stats or ListStats(), on_unreadable)

    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[ObjectInfo]:
        if recursive:
            # The parallel lister; its batches come in no order, so a whole (prefix) listing is sorted here.
            found = [
                ObjectInfo(key=e.key, size=e.size, mtime=e.mtime, etag=e.etag)
                for batch in self.walk(jobs=8, within=prefix)
                for e in batch
            ]
            found.sort(key=lambda o: o.key.encode())
            yield from found
            return
        full = self._root + prefix
        if full and not full.endswith("/"):
            full += "/"
        cut = len(self._root)
        token: str | None = None
        seen: set[str] = set()
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(f"{self.bucket}/{full}", self.client.list_objects_v2, **kwargs)
            entries = [
                ObjectInfo(
                    key=o["Key"][cut:],
                    size=o["Size"],
                    mtime=o["LastModified"].timestamp(),
                    etag=unquoted_etag(o.get("ETag")),
                )
                for o in page.get("Contents", ())
                if not o["Key"].endswith("/")
            ]  # no "directory markers"
            entries += [
                ObjectInfo(key=p["Prefix"][cut:].rstrip("/"), size=0, mtime=0.0, is_dir=True)
                for p in page.get("CommonPrefixes", ())
            ]
            # Objects and common prefixes come in two lists; merge them into key order.
            entries.sort(key=lambda i: (i.key + ("/" if i.is_dir else "")).encode())
            yield from entries
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            if token in seen:  # the server goes round in circles: a listing that would never end
                raise repeated_token_error(self.endpoint, f"{self.bucket}/{full}")
            seen.add(token)

    # -- reading ------------------------------------------------------------------------------------
    def head(self, key: str) -> ObjectInfo | None:
        from lingctl.core.storage.s3.reply import as_reply

        full = self._key(key)

        def head() -> ObjectInfo | None:
            headers = self.http.head(full)
            return (
                None
                if headers is None
                else parse_reply(key, as_reply(headers, operation="HeadObject", key=full, whole=True))
            )

        try:
            return self.retrier.call(f"{self.bucket}/{full}", head)
        except NotFoundError:
            return None

    def version(self, key: str) -> Version | None:
        # A one-key listing, not a HEAD: listings carry LastModified to the millisecond, HEAD to the second,
        # and a copy records the source mtime that the next run's listing will compare.
        full = self._key(key)
        reply = self._call(
            f"{self.bucket}/{full}", self.client.list_objects_v2, Bucket=self.bucket, Prefix=full, MaxKeys=1
        )
        for o in reply.get("Contents", ()):
            if o["Key"] == full:
                return Version(o["Size"], o["LastModified"].timestamp(), unquoted_etag(o.get("ETag")))
        return None

    def read(self, key: str, offset: int = 0, length: int | None = None, *, pin: Version | None = None) -> bytes:
        if length == 0:
            return b""
        full = self._key(key)
        what = f"{self.bucket}/{full}"
        if_match = f'"{pin.etag}"' if pin is not None and pin.etag else None

        def get() -> bytes:
            import botocore.exceptions

            from lingctl.core.storage.s3.http_wire import AnswerTooLarge

            try:
                body, headers = self.http.get(
                    full, offset=offset, length=length, if_match=if_match, size=pin.size if pin else None
                )
            except botocore.exceptions.ClientError as exc:
                status = response_status(exc)
                if pin is not None and status in (404, 412):
                    change = "overwritten" if status == 412 else "removed"
                    raise SourceChangedError(f"{what}: the object was {change} during the copy") from exc
                raise
            except botocore.exceptions.EndpointConnectionError as exc:
                if pin is not None and isinstance(exc.__cause__, AnswerTooLarge):
                    # More than the listed size came: a larger version (a server that ignores If-Match sends
                    # it whole), or a broken server. The copy starts over from a fresh look at the object.
                    raise SourceChangedError(
                        f"{what}: the server sent more bytes than the {pin.size} listed "
                        "(the object changed during the copy, or the server is broken)"
                    ) from exc
                raise
            if pin is not None:
                _check_version(what, pin, headers)
            return body

        try:
            return self.retrier.call(what, get)
        except UsageError:
            return b""  # 416: the range starts at or past the end, which reads as empty, as a file would

    def download(self, key: str, path: Path) -> ObjectInfo:
        full = self._key(key)
        what = f"{self.bucket}/{full}"

        def fetch(tmp_file: Any) -> ObjectInfo:
            resp = self.client.get_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")
            info = parse_reply(key, resp)
            tmp_file.seek(0)
            tmp_file.truncate()
            crc = Crc64()
            for block in resp["Body"].iter_chunks(1 * _MiB):
                crc.update(block)
                if crc.length > info.size:  # a body past its own Content-Length must not fill the disk
                    raise RetryableError(f"{what}: the server sent more than the object's {info.size} bytes")
                try:
                    tmp_file.write(block)
                except OSError as exc:
                    raise os_error(exc, str(path)) from exc
            if crc.length != info.size:
                raise RetryableError(f"{what}: connection ended after {crc.length} of {info.size} bytes")
            if info.checksum is not None and crc.tagged() != info.checksum:
                raise VerificationError(
                    f"checksum mismatch for s3://{what}: recorded {info.checksum}, received {crc.tagged()}",
                    hint="the stored object is damaged or was changed during the copy; nothing was written",
                )
            return info

        with atomic_write(Path(path)) as (_, f):
            return self.retrier.call(what, fetch, f)

    def checksum(self, key: str) -> str | None:
        """The recorded CRC64NVME (our metadata, or S3's own field); None for objects written without one."""
        return self.stat(key).checksum

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
        crc = crc or crc64_bytes(data)
        full = self._key(key)
        # Content-MD5, as rclone sends it: every S3 server checks it (AWS also checks the CRC64NVME, but
        # several S3-compatible servers, rclone's among them, ignore that header).
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode() if server_check else None
        headers = self.retrier.call(
            f"{self.bucket}/{full}",
            self.http.put,
            full,
            data,
            metadata=object_metadata(mtime=mtime, mtime_ns=mtime_ns, crc=crc.tagged()),
            checksum_crc64nvme_b64=crc.b64(),
            content_md5_b64=md5,
        )
        etag = unquoted_etag(headers.get("ETag"))
        return ObjectInfo(key=key, size=crc.length, mtime=time.time(), checksum=crc.tagged(), etag=etag)

    def upload(self, key: str, path: Path) -> ObjectInfo:
        path = Path(path)
        try:
            size = path.stat().st_size
            crc = crc64_file(path)  # ~8 GB/s: cheap next to the upload, and lets the server verify the PUT
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        if size < self.options.multipart_threshold:
            with open(path, "rb") as f:
                return self.write(key, f.read(), crc=crc)
        return self._upload_parts(key, path, size, crc)

    def _upload_parts(self, key: str, path: Path, size: int, crc: Crc64) -> ObjectInfo:
        """A sequential multipart upload; the object appears under ``key`` only when it completes, and an
        upload that fails is aborted so its parts do not linger (and cost money)."""
        uploads = self.multipart
        upload_id = uploads.create(key, size, crc=crc.tagged())
        parts = []
        try:
            with open(path, "rb") as f:
                number, offset = 1, 0
                while block := f.read(self.options.part_size):
                    parts.append((number, uploads.put_part(key, upload_id, number, offset, block)))
                    number, offset = number + 1, offset + len(block)
            info = uploads.complete(key, upload_id, parts)
        except BaseException:
            try:
                uploads.abort(key, upload_id)
            except Exception:  # the original error matters more; a stale upload is cleaned by lifecycle rules
                log.warning("could not abort multipart upload %s of %s/%s", upload_id, self.bucket, key)
            raise
        return ObjectInfo(key=key, size=size, mtime=info.mtime, checksum=crc.tagged(), etag=info.etag)

    def delete(self, key: str) -> None:
        full = self._key(key)
        self.retrier.call(f"{self.bucket}/{full}", self.http.delete, full)


class _S3Uploads(MultipartUploads):
    """S3 multipart uploads. They outlive the process, so a later run can continue one from its finished
    parts (``resumable``). A reply that says the server no longer knows the upload (NoSuchUpload, a bare
    404, or InvalidPart for parts it lost) raises ``UploadGoneError``: resending cannot help, a new upload can."""

    resumable = True

    def __init__(self, store: S3Store) -> None:
        self.store = store

    def create(
        self, key: str, size: int, *, mtime: float | None = None, mtime_ns: int | None = None, crc: str | None = None
    ) -> str:
        store = self.store
        full = store._key(key)
        meta = object_metadata(mtime=mtime, mtime_ns=mtime_ns, crc=crc)
        return store.retrier.call(f"{store.bucket}/{full}", store.http.create_multipart, full, metadata=meta)

    def _on_upload(self, key: str, upload_id: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        store = self.store

        def call() -> Any:
            import botocore.exceptions

            try:
                return fn(full, upload_id, *args, **kwargs)
            except botocore.exceptions.ClientError as exc:
                code = response_code(exc)
                if code in ("NoSuchUpload", "InvalidPart") or response_status(exc) == 404:
                    raise UploadGoneError(
                        f"{store.bucket}/{full}: the server no longer knows multipart "
                        f"upload {upload_id[:16]}... ({code or 404})"
                    ) from exc
                raise

        full = store._key(key)
        return store.retrier.call(f"{store.bucket}/{full}", call)

    def put_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes, *, server_check: bool = False
    ) -> str:
        # Content-MD5 per part, as for a single PUT: the server refuses a part that arrived different.
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode() if server_check else None
        return self._on_upload(key, upload_id, self.store.http.upload_part, number, data, content_md5_b64=md5)

    def complete(
        self,
        key: str,
        upload_id: str,
        parts: list[tuple[int, str]],
        *,
        mtime: float | None = None,
        mtime_ns: int | None = None,
    ) -> ObjectInfo:
        etag = self._on_upload(key, upload_id, self.store.http.complete_multipart, parts)
        # Some servers list a multipart object under another ETag than CompleteMultipartUpload returned
        # (rclone's lists the MD5 of the stored file). One HEAD per large object records the one that
        # listings show, so re-syncs recognise the object without a HEAD each time.
        head = self.store.head(key)
        return ObjectInfo(
            key=key,
            size=head.size if head is not None else 0,
            mtime=time.time(),
            etag=head.etag if head is not None else (etag or None),
            checksum=head.checksum if head is not None else None,
        )

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self._on_upload(key, upload_id, self.store.http.abort_multipart)
        except LingctlError:
            pass  # an upload that is already gone needs no abort


def _check_version(what: str, pin: Version, headers: Mapping[str, str]) -> None:
    """Raise ``SourceChangedError`` unless a GET answer is of the pinned version: same ETag (when pinned)
    and the same total size (``Content-Range: bytes a-b/TOTAL``, or the length of a whole-object GET).
    Only these headers are read: whatever else the server sends does not matter here."""
    etag = unquoted_etag(headers.get("ETag"))
    if pin.etag and etag and etag != pin.etag:
        raise SourceChangedError(f"{what}: the object was overwritten during the copy (ETag {pin.etag} -> {etag[:80]})")
    content_range = headers.get("Content-Range") or ""
    total = content_range.rpartition("/")[2] if content_range else (headers.get("Content-Length") or "")
    if total.isascii() and total.isdigit() and int(total) != pin.size:
        raise SourceChangedError(
            f"{what}: the object was overwritten during the copy (size {pin.size} -> {total[:20]})"
        )
