"""The S3 store (AWS S3 or any S3-compatible server), through boto3, imported only when used.

Endpoint, credentials and region follow the standard AWS chain: ``--endpoint-url`` or ``AWS_ENDPOINT_URL``
(``AWS_ENDPOINT_URL_S3``), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` and the shared config files. Secrets never appear in messages: errors name the endpoint,
bucket and key only.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.checksum import Crc64, crc64_bytes, crc64_file, tag_from_b64
from lingctl.core.errors import (
    AccessDeniedError,
    LingctlError,
    NotFoundError,
    RetryableError,
    UsageError,
    VerificationError,
    os_error,
)
from lingctl.core.storage.base import ObjectInfo, ObjectStore
from lingctl.core.storage.url import StoreURL, check_endpoint_url, check_key

log = logging.getLogger(__name__)

# Object metadata that carries the CRC64NVME where the server keeps no checksum of its own (multipart
# uploads on many S3-compatible servers). S3 lower-cases metadata names.
CHECKSUM_META = "lingctl-crc64nvme"
_MiB = 1 << 20
_GiB = 1 << 30


@dataclass(kw_only=True, slots=True)
class S3Options:
    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS itself
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / profile, else us-east-1
    profile: str | None = None  # None: AWS_PROFILE / default
    # Path-style addressing (http://host/bucket/key). None: on for custom endpoints, which rarely have
    # wildcard DNS for virtual-host buckets, and off for AWS itself.
    path_style: bool | None = None
    max_attempts: int = 3  # botocore "standard" retries: throttling, 5xx and connection errors
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    # Files at least this large go up as multipart uploads with parts of part_size (S3: 5 MiB .. 5 GiB).
    multipart_threshold: int = 64 * _MiB
    part_size: int = 64 * _MiB

    def resolved_endpoint(self) -> str | None:
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if not endpoint:
            return None
        # Validated and stripped of any user:password (never used: requests are signed), so no message or
        # report built from it can leak one, whoever calls the library.
        return check_endpoint_url(endpoint)

    def validate(self) -> None:
        if self.max_attempts < 1:
            raise UsageError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not (5 * _MiB <= self.part_size <= 5 * _GiB):
            raise UsageError(f"part_size must be between 5 MiB and 5 GiB (S3's limits), got {self.part_size}")
        if self.multipart_threshold < 1:
            raise UsageError(f"multipart_threshold must be positive, got {self.multipart_threshold}")


def make_client(options: S3Options, *, unsigned: bool = False) -> Any:
    """A boto3 S3 client for ``options``; raises ``UsageError`` for a bad endpoint, profile or region.

    ``unsigned`` sends anonymous requests (public buckets, or checking that an endpoint answers at all)."""
    options.validate()
    import boto3
    import botocore
    import botocore.config
    import botocore.exceptions

    endpoint = options.resolved_endpoint()
    try:
        session = boto3.session.Session(profile_name=options.profile)
    except botocore.exceptions.ProfileNotFound:
        raise UsageError(f"AWS profile {options.profile!r} not found", hint="check ~/.aws/config or AWS_PROFILE") from None
    region = options.region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
    path_style = options.path_style if options.path_style is not None else endpoint is not None
    config = botocore.config.Config(
        region_name=region,
        s3={"addressing_style": "path" if path_style else "auto"},
        # total_max_attempts counts the first try; botocore's max_attempts would count only the retries.
        retries={"total_max_attempts": options.max_attempts, "mode": "standard"},
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        # We compute and send CRC64NVME ourselves. "when_required" on responses: several S3-compatible
        # servers send a whole-object CRC with ranged GETs, which botocore would reject.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=64,
        **({"signature_version": botocore.UNSIGNED} if unsigned else {}),
    )
    try:
        return session.client("s3", endpoint_url=endpoint, config=config)
    except ValueError as exc:
        raise UsageError(f"cannot create S3 client: {exc}") from None


def translate(exc: Exception, what: str, endpoint: str, attempts: int) -> LingctlError:
    """Map a boto3/botocore exception on ``what`` (bucket/key) to a lingctl error kind, without secrets."""
    import botocore.exceptions as bx

    where = endpoint or "AWS S3"
    if isinstance(exc, bx.NoCredentialsError):
        return AccessDeniedError(
            f"no S3 credentials found for {where}",
            hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
        )
    if isinstance(exc, bx.PartialCredentialsError):
        return AccessDeniedError(f"incomplete S3 credentials: {exc}", hint="set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                        bx.ConnectionClosedError)):
        return RetryableError(
            f"could not reach S3 endpoint {where} after {attempts} attempt(s) ({type(exc).__name__})",
            hint="check --endpoint-url / AWS_ENDPOINT_URL and that the server is running",
        )
    if isinstance(exc, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)):
        # A connection that broke mid-request or mid-body (reset, truncated stream): a new request can work.
        return RetryableError(f"connection to S3 endpoint {where} broke during {what} after {attempts} attempt(s) "
                              f"({type(exc).__name__})")
    if isinstance(exc, bx.FlexibleChecksumError):  # botocore checked S3's own checksum field on a GET
        return VerificationError(f"checksum mismatch for {what} at {where}: {exc}",
                                 hint="the stored object is damaged; nothing was written")
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = err.get("Message") or code
        # HeadBucket answers a bare 404 without a code; ``what`` is then the bucket name alone.
        if code == "NoSuchBucket" or (status == 404 and "/" not in what):
            return NotFoundError(f"bucket {what.split('/')[0]!r} does not exist at {where}")
        if code == "NoSuchUpload":
            return NotFoundError(f"{what}: the multipart upload no longer exists at {where} (aborted, or the "
                                 "server restarted)", hint="run the same command again to start a new upload")
        if code == "PreconditionFailed" or status == 412:
            return RetryableError(f"{what}: the object changed at {where} while it was being read")
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return NotFoundError(f"{what}: not found at {where}")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AuthorizationHeaderMalformed",
                    "InvalidToken", "ExpiredToken", "TokenRefreshRequired"):
            return AccessDeniedError(
                f"S3 rejected the credentials for {what} at {where} ({code})",
                hint="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
            )
        if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
            return AccessDeniedError(f"access denied to {what} at {where}", hint="check the credentials' permissions")
        if code in ("InvalidRange",) or status == 416:
            return UsageError(f"{what}: requested range is outside the object")
        if status >= 500 or code in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                                      "InternalError", "ServiceUnavailable"):
            return RetryableError(f"S3 error on {what} at {where} after {attempts} attempt(s): {code}: {message}")
        return LingctlError(f"S3 error on {what} at {where}: {code}: {message}")
    if isinstance(exc, bx.BotoCoreError):
        return LingctlError(f"S3 error on {what} at {where}: {exc}")
    raise exc


class S3Store(ObjectStore):
    def __init__(self, url: StoreURL, options: S3Options | None = None) -> None:
        if not url.is_s3:
            raise ValueError(f"not an s3:// URL: {url}")
        self.url = url
        self.options = options or S3Options()
        self.bucket = url.bucket
        self._root = f"{url.prefix}/" if url.prefix else ""
        self.endpoint = self.options.resolved_endpoint() or ""
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        # Created on first use (boto3 import and credential resolution cost ~0.3 s); clients are thread-safe.
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = make_client(self.options)
        return self._client

    def describe(self) -> str:
        return f"{self.url} at {self.endpoint or 'AWS S3'}"

    def _key(self, key: str) -> str:
        return self._root + check_key(key)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:  # translated into our kinds; anything unknown is re-raised as is
            raise translate(exc, what, self.endpoint, self.options.max_attempts) from exc

    def check(self) -> None:
        self._call(self.bucket, self.client.head_bucket, Bucket=self.bucket)

    # -- listing ------------------------------------------------------------------------------------
    def list(self, prefix: str = "", *, recursive: bool = True) -> Iterator[ObjectInfo]:
        full = self._root + prefix
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
        if not recursive:
            if full and not full.endswith("/"):
                full += "/"
            kwargs.update(Prefix=full, Delimiter="/")
        paginator = self.client.get_paginator("list_objects_v2")
        cut = len(self._root)
        try:
            for page in paginator.paginate(**kwargs):
                entries: list[ObjectInfo] = [
                    ObjectInfo(key=o["Key"][cut:], size=o["Size"], mtime=o["LastModified"].timestamp(),
                               etag=o.get("ETag", "").strip('"') or None)
                    for o in page.get("Contents", ())
                    if not o["Key"].endswith("/")  # zero-byte "directory markers" are not objects
                ]
                entries += [ObjectInfo(key=p["Prefix"][cut:].rstrip("/"), size=0, mtime=0.0, is_dir=True)
                            for p in page.get("CommonPrefixes", ())]
                if not recursive:
                    # Objects and common prefixes come in two lists; merge them into key order.
                    entries.sort(key=lambda i: i.key + ("/" if i.is_dir else ""))
                yield from entries
        except Exception as exc:
            raise translate(exc, f"{self.bucket}/{full}", self.endpoint, self.options.max_attempts) from exc

    # -- reading ------------------------------------------------------------------------------------
    def stat(self, key: str) -> ObjectInfo:
        full = self._key(key)
        head = self._call(f"{self.bucket}/{full}", self.client.head_object, Bucket=self.bucket, Key=full,
                          ChecksumMode="ENABLED")
        return self._info(key, head)

    @staticmethod
    def _info(key: str, head: dict[str, Any]) -> ObjectInfo:
        # Our metadata was computed from the source bytes at upload; some S3-compatible servers compute
        # their checksum field from whatever is stored now, which would hide damage at rest. Prefer ours.
        # AWS lower-cases metadata names; some servers keep the sender's case.
        meta = {k.lower(): v for k, v in head.get("Metadata", {}).items()}
        b64 = meta.get(CHECKSUM_META)
        if not b64 and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
            b64 = head.get("ChecksumCRC64NVME")  # a composite multipart CRC ("...-N") is not comparable
        return ObjectInfo(key=key, size=head["ContentLength"], mtime=head["LastModified"].timestamp(),
                          checksum=tag_from_b64(b64) if b64 else None, etag=head.get("ETag", "").strip('"') or None)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self._key(key)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if length == 0:
            return b""
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            kwargs["Range"] = f"bytes={offset}-{end}"
        what = f"{self.bucket}/{full}"
        try:
            resp = self.client.get_object(**kwargs)
        except Exception as exc:
            err = translate(exc, what, self.endpoint, self.options.max_attempts)
            if isinstance(err, UsageError):
                return b""  # 416: the range starts at or past the end, which reads as empty, as a file would
            raise err from exc
        try:
            return resp["Body"].read()
        except Exception as exc:
            raise translate(exc, what, self.endpoint, self.options.max_attempts) from exc

    def download(self, key: str, path: Path) -> ObjectInfo:
        full = self._key(key)
        what = f"{self.bucket}/{full}"
        resp = self._call(what, self.client.get_object, Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")
        info = self._info(key, resp)
        crc = Crc64()
        with atomic_write(Path(path)) as (_, f):
            try:
                for block in resp["Body"].iter_chunks(1 * _MiB):
                    crc.update(block)
                    f.write(block)
            except OSError as exc:
                raise os_error(exc, str(path)) from exc
            except Exception as exc:
                raise translate(exc, what, self.endpoint, self.options.max_attempts) from exc
            if crc.length != info.size:
                raise RetryableError(f"{what}: connection ended after {crc.length} of {info.size} bytes")
            if info.checksum is not None and crc.tagged() != info.checksum:
                raise VerificationError(
                    f"checksum mismatch for s3://{what}: recorded {info.checksum}, received {crc.tagged()}",
                    hint="the stored object is damaged or was changed during the copy; nothing was written",
                )
        return info

    # -- writing ------------------------------------------------------------------------------------
    def write(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        crc = crc64_bytes(data)
        return self._put(key, io.BytesIO(bytes(data)), crc)

    def upload(self, key: str, path: Path) -> ObjectInfo:
        path = Path(path)
        try:
            size = path.stat().st_size
            crc = crc64_file(path)  # ~8 GB/s: cheap next to the upload, and lets the server verify the PUT
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        if size < self.options.multipart_threshold:
            with open(path, "rb") as f:
                return self._put(key, f, crc)
        return self._multipart(key, path, crc)

    def _put(self, key: str, body: Any, crc: Crc64) -> ObjectInfo:
        full = self._key(key)
        resp = self._call(f"{self.bucket}/{full}", self.client.put_object, Bucket=self.bucket, Key=full, Body=body,
                          ChecksumCRC64NVME=crc.b64(), Metadata={CHECKSUM_META: crc.b64()})
        return ObjectInfo(key=key, size=crc.length, mtime=time.time(), checksum=crc.tagged(),
                          etag=resp.get("ETag", "").strip('"') or None)

    def _multipart(self, key: str, path: Path, crc: Crc64) -> ObjectInfo:
        """Sequential multipart upload; the object appears under ``key`` only when CompleteMultipartUpload
        succeeds, and an upload that fails is aborted so its parts do not linger (and cost money)."""
        full = self._key(key)
        what = f"{self.bucket}/{full}"
        created = self._call(what, self.client.create_multipart_upload, Bucket=self.bucket, Key=full,
                             Metadata={CHECKSUM_META: crc.b64()})
        upload_id = created["UploadId"]
        parts = []
        try:
            with open(path, "rb") as f:
                number = 1
                while block := f.read(self.options.part_size):
                    part = self._call(what, self.client.upload_part, Bucket=self.bucket, Key=full,
                                      UploadId=upload_id, PartNumber=number, Body=block)
                    parts.append({"PartNumber": number, "ETag": part["ETag"]})
                    number += 1
            resp = self._call(what, self.client.complete_multipart_upload, Bucket=self.bucket, Key=full,
                              UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception:  # the original error matters more; a stale upload is cleaned by lifecycle rules
                log.warning("could not abort multipart upload %s of %s", upload_id, what)
            raise
        return ObjectInfo(key=key, size=crc.length, mtime=time.time(), checksum=crc.tagged(),
                          etag=resp.get("ETag", "").strip('"') or None)

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._call(f"{self.bucket}/{full}", self.client.delete_object, Bucket=self.bucket, Key=full)

    def checksum(self, key: str) -> str | None:
        """The recorded CRC64NVME (S3's own field, or our metadata); None for objects written without one."""
        return self.stat(key).checksum

