"""S3 requests (object GET, HEAD, PUT, DELETE, multipart uploads, HeadBucket, ListObjectsV2) as signed HTTP
requests on a keep-alive pool.

boto3's client spends far more CPU per request than the request itself costs the server: building the
request from the service model, a dozen event hooks, response parsing into dicts and datetimes, checksum
plumbing. Copying thousands of small objects pays that thousands of times. This client keeps only what the
wire needs: the URL, SigV4 headers (``sigv4``, lingctl's own signer, with credentials and region resolved as
``make_client`` resolves them), one request on a shared, thread-safe connection pool (``http_wire``; urllib3's
behind an https:// proxy), and the answer's status, headers and body. The S3 lister sends its ListObjectsV2
pages through it too.

Each call sends exactly one request; there are no retries here, so the caller's retry and AIMD policy sees
every failure. Failures come out as two exception types of ``reply``, both subclasses of botocore's, so
``translate()`` and the throttle checks classify them as botocore's own:

- ``S3HTTPError`` (a ``ClientError``): the server answered with an error status. It carries ``status``,
  ``code`` (S3's error code from the XML body, or the status as text for bodiless answers such as HEAD's)
  and ``message``, and ``response`` shaped as botocore's (``Error.Code``, ``ResponseMetadata.HTTPStatusCode``).
- ``S3ConnectionError`` (an ``EndpointConnectionError``): no complete answer: refused, reset, timed out, or a
  body cut short, malformed, too large or too slow. Always worth retrying.

A certificate that fails verification is neither: it raises ``CertificateError`` at once, since sending the
request again cannot help.

Every answer is bounded (``http_wire``): a GET by the range asked for or the object's size when the caller
knows it (``size``), else by ``MAX_UNSIZED_READ``; every other answer by ``_SMALL_ANSWER``, error answers by
1 MiB. Behind an ``https://`` proxy the requests go through urllib3, where only part of that holds
(``http_wire.ProxiedPool``).

Payload hashing: a PUT is signed with ``UNSIGNED-PAYLOAD`` when it goes over https or carries a CRC64NVME
header, and with the body's SHA-256 otherwise (``sign_payload`` overrides). The AWS SDKs and aws-cli send
UNSIGNED-PAYLOAD only over https with a checksum header; rclone sends it over plain http too (with
Content-MD5). With the checksum header, which is itself signed, AWS rejects a body damaged on the way; the
SHA-256 would add protection against deliberate tampering on a plain-http path, at about 0.8 ms of CPU per
MiB (12 us per 16 KiB PUT, 0.5 s for a 600 MB copy). Note that ``rclone serve s3`` (v1.75) checks neither
the SHA-256 nor the CRC64NVME of a body, only Content-MD5.

Importing this module imports botocore's exception classes (not its signer or session; urllib3 only behind an
https:// proxy): import it where S3 is actually used.
"""

from __future__ import annotations

import hashlib
import html
import mimetypes
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

import botocore.exceptions

from lingctl.core.storage.s3 import http_wire, sigv4
from lingctl.core.storage.s3.client import S3Options, ca_bundle, certificate_error, profile_not_found, translate
from lingctl.core.storage.s3.reply import (
    META_PREFIX,
    Headers,
    S3ConnectionError,
    S3HTTPError,
    describe_wire,
    http_error,
)

_UPLOAD_ID_RE = re.compile(r"<UploadId>([^<]*)</UploadId>")
_ETAG_RE = re.compile(r"<ETag>([^<]*)</ETag>")
# Buckets that can be a DNS label under the endpoint's host; others go path style, as botocore's "auto" does.
_DNS_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
# The largest whole-object GET whose size the caller does not know (markers, manifests, doctor's probe
# object, at most 1 GiB): a server that sends more is refused. Reads of listed objects are bounded by
# their listed size instead, ranged reads by the range.
MAX_UNSIZED_READ = 1 << 30
# Answers that are not object data: an empty PUT or DELETE answer, the small XML of the multipart requests.
_SMALL_ANSWER = 1 << 20
# CompleteMultipartUpload may take minutes (AWS: "several minutes"), sending a space every few seconds to
# keep the connection open; its answer is bounded by this total time instead of the low-speed rule.
_COMPLETE_S = 30 * 60.0


def _addressing(netloc: str, path: str, bucket: str, *, path_style: bool) -> tuple[str, str]:
    """The Host header and the path prefix of the bucket's requests at the endpoint ``netloc``/``path``."""
    # Dotted (or otherwise non-DNS) bucket names cannot be a virtual host under a TLS wildcard certificate;
    # botocore sends them path style too.
    if path_style or not _dns_compatible(bucket):
        return netloc, f"{path.rstrip('/')}/{quote(bucket, safe='')}/"
    return f"{bucket}.{netloc}", f"{path.rstrip('/')}/"


def _dns_compatible(bucket: str) -> bool:
    return _DNS_BUCKET_RE.match(bucket) is not None and "--" not in bucket[2:4]


class SignedS3Client:
    """Objects of one bucket over signed HTTP requests. Keys are full object keys (no store prefix added).

    One instance is shared by many threads: the connection pool hands each request its own connection and
    credentials are frozen per request (refreshable credentials stay fresh). ``max_connections`` connections
    are kept open for reuse; more concurrent requests still go through, on connections closed afterwards.
    """

    def __init__(
        self,
        options: S3Options,
        bucket: str,
        *,
        unsigned: bool = False,
        max_connections: int = 16,
        sign_payload: bool | None = None,
    ) -> None:
        options.validate()
        self.bucket = bucket
        endpoint = options.resolved_endpoint()
        self.endpoint = endpoint or ""  # for messages; resolved_endpoint has no user info in it
        try:
            # The same resolution as make_client: AWS_REGION, then AWS_DEFAULT_REGION or the profile's region.
            credentials, region = sigv4.resolve(options.profile, options.region)
        except botocore.exceptions.ProfileNotFound:
            raise profile_not_found(options.profile or os.environ.get("AWS_PROFILE")) from None
        self.credentials: Any = None if unsigned else credentials
        if not unsigned and self.credentials is None:
            raise translate(botocore.exceptions.NoCredentialsError(), bucket, self.endpoint, 1)
        self.region: str = region
        self._signer = sigv4.Signer(self.credentials, region) if self.credentials is not None else None
        path_style = options.path_style if options.path_style is not None else endpoint is not None
        if endpoint is None:
            suffix = "amazonaws.com.cn" if self.region.startswith("cn-") else "amazonaws.com"
            endpoint = f"https://s3.{self.region}.{suffix}"
        parts = urlsplit(endpoint)
        self.host, self._prefix = _addressing(parts.netloc, parts.path, bucket, path_style=path_style)
        self._origin = f"{parts.scheme}://{self.host}"
        https = parts.scheme == "https"
        self._https = https
        self.sign_payload = sign_payload  # None: hash the body only over http and without a checksum header
        ca_certs = ca_bundle() if https else None
        # lingctl's own keep-alive client (directly or through an http:// proxy): a third of urllib3's CPU
        # per request (http_wire's docstring), which is most of the client's work on small objects.
        self._wire = http_wire.open_pool(
            self._origin,
            connect_timeout=options.connect_timeout,
            read_timeout=options.read_timeout,
            low_speed_limit=options.low_speed_limit,
            maxsize=max_connections,
            ca_certs=ca_certs,
        )
        self._user_agent = f"lingctl/{_version()}"

    def close(self) -> None:
        self._wire.close()

    def __enter__(self) -> SignedS3Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self, key: str) -> str:
        """Where requests for ``key`` go (path style or virtual host, per ``S3Options.path_style``)."""
        return self._origin + self._target(key)

    def _target(self, key: str) -> str:
        # Percent-encoded as botocore encodes keys (everything but letters, digits and "-_.~/"); S3's
        # signature covers the path exactly as sent, so this is also the canonical URI.
        return self._prefix + quote(key, safe="/~")

    # -- requests ---------------------------------------------------------------------------------------
    def get(
        self,
        key: str,
        *,
        offset: int = 0,
        length: int | None = None,
        if_match: str | None = None,
        checksum_mode: bool = False,
        size: int | None = None,
    ) -> tuple[bytes, Headers]:
        """The object's bytes from ``offset`` (``length`` of them, or to the end) and the answer's headers.

        A ranged answer carries ``Content-Range: bytes A-B/TOTAL`` (AWS answers 206, rclone serve s3 200).
        Starting at or past the end answers 416 InvalidRange. ``if_match`` (an ETag, quoted or not) makes AWS
        answer 412 PreconditionFailed when the object is no longer that version; rclone serve s3 (v1.75)
        ignores it, so a caller that pins a version still compares the answer's ETag. ``checksum_mode`` asks
        for the stored checksum headers (AWS sends them only when asked); nothing here checks the body
        against them. ``size``: the object's size, when the caller knows it (from a listing or a HEAD).

        The answer may bring no more than was asked for: the range, else ``size``, else ``MAX_UNSIZED_READ``
        bytes (a server that ignores Range may send the whole object, up to ``size`` or that limit). More is
        ``S3ConnectionError`` whose cause is ``http_wire.AnswerTooLarge``, and nothing more is read.
        """
        if offset < 0 or (length is not None and length < 1):
            raise ValueError(f"need offset >= 0 and length >= 1 (or None), got offset={offset}, length={length}")
        headers: dict[str, str] = {}
        whole = size if size is not None else MAX_UNSIZED_READ
        limit: http_wire.Limit = whole
        if offset or length is not None:
            headers["Range"] = f"bytes={offset}-{'' if length is None else offset + length - 1}"
            part = length if length is not None else (max(0, size - offset) if size is not None else whole)
            limit = _range_limit(part, whole)

        # An ETag is data from a listing: sent only when it cannot break the request's header block.
        if if_match is not None and if_match.isascii() and if_match.isprintable():
            headers["If-Match"] = if_match if if_match.startswith('"') or if_match == "*" else f'"{if_match}"'
        if checksum_mode:
            headers["x-amz-checksum-mode"] = "ENABLED"
        resp = self._send("GET", "GetObject", key, headers, None, limit=limit)
        if "Range" in headers and "Content-Range" not in resp.headers:
            # A server that ignores Range sends the whole object; cut out what was asked for. (Status 200
            # alone does not tell: rclone serve s3 answers ranged reads with 200 and a Content-Range.)
            end = None if length is None else offset + length
            return resp.data[offset:end], resp.headers
        return resp.data, resp.headers

    def head(self, key: str) -> Headers | None:
        """The object's headers (size, ETag, Last-Modified, ``x-amz-meta-*``), or None when it does not exist.

        HEAD answers have no body, so a 404 cannot tell a missing key from a missing bucket; both are None.
        The stored checksum headers are asked for (``x-amz-checksum-mode``), as the S3 store's stat does.
        """
        try:
            return self._send("HEAD", "HeadObject", key, {"x-amz-checksum-mode": "ENABLED"}, None).headers
        except S3HTTPError as exc:
            if exc.status == 404:
                return None
            raise

    def put(
        self,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        metadata: Mapping[str, str],
        checksum_crc64nvme_b64: str | None,
        content_md5_b64: str | None = None,
    ) -> Headers:
        """Write ``body`` as the whole object ``key`` with user ``metadata`` (``x-amz-meta-NAME``: ASCII names
        and values); with ``checksum_crc64nvme_b64`` the server checks the body against it and keeps it.
        No ``Expect: 100-continue``: the body is sent right behind the headers."""
        headers = {"Content-Length": str(memoryview(body).nbytes), "Content-Type": content_type(key)}
        if checksum_crc64nvme_b64 is not None:
            headers["x-amz-checksum-crc64nvme"] = checksum_crc64nvme_b64
        if content_md5_b64 is not None:  # the server refuses (400 BadDigest) a body whose MD5 differs
            headers["Content-MD5"] = content_md5_b64
        for name, value in _checked_metadata(metadata).items():
            headers[META_PREFIX + name] = value
        return self._send("PUT", "PutObject", key, headers, body).headers

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a key that does not exist succeeds, as S3 answers 204 either way."""
        self._send("DELETE", "DeleteObject", key, {}, None)

    # -- multipart uploads --------------------------------------------------------------------------------
    def create_multipart(self, key: str, *, metadata: Mapping[str, str]) -> str:
        """CreateMultipartUpload with user ``metadata``; the new upload's id."""
        headers = {META_PREFIX + name: value for name, value in _checked_metadata(metadata).items()}
        headers["Content-Type"] = content_type(key)
        resp = self._send("POST", "CreateMultipartUpload", key, headers, None, query="uploads=")
        found = _UPLOAD_ID_RE.search(resp.data.decode("utf-8", errors="replace"))
        if found is None:
            raise S3HTTPError(
                status=resp.status,
                code="MalformedReply",
                message="no UploadId in the answer",
                operation="CreateMultipartUpload",
                key=key,
            )
        return html.unescape(found.group(1))

    def upload_part(
        self,
        key: str,
        upload_id: str,
        number: int,
        body: bytes | bytearray | memoryview,
        *,
        content_md5_b64: str | None = None,
    ) -> str:
        """UploadPart ``number`` (1-based); the part's ETag, unquoted. With ``content_md5_b64`` the server
        refuses (400 BadDigest) a part whose body arrived different."""
        headers = {"Content-Length": str(memoryview(body).nbytes)}
        if content_md5_b64 is not None:
            headers["Content-MD5"] = content_md5_b64
        resp = self._send(
            "PUT",
            "UploadPart",
            key,
            headers,
            body,
            query=f"partNumber={number}&uploadId={quote(upload_id, safe='-_.~')}",
        )
        return (resp.headers.get("ETag") or "").strip('"')

    def complete_multipart(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str:
        """CompleteMultipartUpload from ``(number, etag)`` pairs in order; the object's ETag, unquoted.
        S3 may answer 200 and still fail (an ``<Error>`` body, sent after a long assembly): that is raised."""
        xml = "".join(
            f'<Part><PartNumber>{n}</PartNumber><ETag>"{html.escape(e.strip(chr(34)))}"</ETag></Part>' for n, e in parts
        )
        body = f"<CompleteMultipartUpload>{xml}</CompleteMultipartUpload>".encode()
        resp = self._send(
            "POST",
            "CompleteMultipartUpload",
            key,
            {"Content-Length": str(len(body))},
            body,
            query=f"uploadId={quote(upload_id, safe='-_.~')}",
            slow_answer_s=_COMPLETE_S,
        )
        text = resp.data.decode("utf-8", errors="replace")
        if "<Error>" in text:
            raise http_error(resp, "CompleteMultipartUpload", key, status=500)
        found = _ETAG_RE.search(text)
        return html.unescape(found.group(1)).replace("&quot;", "").strip('"') if found else ""

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """AbortMultipartUpload; the parts sent so far are dropped."""
        self._send("DELETE", "AbortMultipartUpload", key, {}, None, query=f"uploadId={quote(upload_id, safe='-_.~')}")

    def head_bucket(self) -> None:
        """HeadBucket: returns when the bucket exists and the credentials may use it; ``S3HTTPError`` 404 or
        403 otherwise (a HEAD answer has no body, so the code is the status)."""
        self._send("HEAD", "HeadBucket", "", {}, None, target=self._bucket_target())

    def list_objects(self, params: Mapping[str, str], *, limit: int) -> str:
        """One ListObjectsV2 page of the bucket (``params``: the query, e.g. ``list-type``, ``prefix``,
        ``continuation-token``), as the answer's text; an answer larger than ``limit`` bytes is refused."""
        # Encoded exactly as SigV4 canonicalises it, so the signed query is the one sent.
        query = "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))
        resp = self._send("GET", "ListObjectsV2", "", {}, None, target=self._bucket_target(), query=query, limit=limit)
        return resp.data.decode("utf-8", errors="replace")

    def _bucket_target(self) -> str:
        return self._prefix.rstrip("/") or "/"

    # -- one request ------------------------------------------------------------------------------------
    def _send(
        self,
        method: str,
        operation: str,
        key: str,
        headers: dict[str, str],
        body: bytes | bytearray | memoryview | None,
        *,
        target: str | None = None,
        query: str = "",
        limit: http_wire.Limit = _SMALL_ANSWER,
        slow_answer_s: float | None = None,
    ) -> http_wire.Reply:
        target = self._target(key) if target is None else target
        if query:
            target = f"{target}?{query}"
        headers["Host"] = self.host
        if self._signer is not None:  # set exactly when there are credentials
            if body is None:
                payload = sigv4.EMPTY_SHA256
            elif self.sign_payload or (
                self.sign_payload is None and not self._https and "x-amz-checksum-crc64nvme" not in headers
            ):
                payload = hashlib.sha256(body).hexdigest()
            else:
                payload = sigv4.UNSIGNED_PAYLOAD
            path, _, query = target.partition("?")
            headers = self._signer.sign(method, path, query, headers, payload)
        headers["User-Agent"] = self._user_agent  # after signing: never signed, so proxies may rewrite it
        try:
            resp = self._wire.request(method, target, headers, body, limit=limit, slow_answer_s=slow_answer_s)
        except http_wire.WireError as exc:
            where = self.endpoint or self._origin
            if (cert := http_wire.certificate_failure(exc)) is not None:
                raise certificate_error(where, cert) from exc  # retrying cannot fix it
            reached = not isinstance(exc, http_wire.ConnectError)
            raise S3ConnectionError(endpoint_url=where, error=describe_wire(exc), reached=reached) from exc
        if resp.status >= 300:
            raise http_error(resp, operation, key)
        return resp


def _range_limit(part: int, whole: int) -> http_wire.Limit:
    """A ranged GET's body limit: the range, or the whole object from a server that ignores Range."""

    def limit(status: int, answer: Headers) -> int:
        return part if "Content-Range" in answer else whole

    return limit


# Python's built-in table only (not the machine's /etc/mime.types), so a key gets the same type everywhere.
_MIME = mimetypes.MimeTypes(filenames=())


def content_type(key: str) -> str:
    """The Content-Type an object is stored with, from its name's extension as rclone does (``a.png``:
    ``image/png``); ``application/octet-stream`` for names the table does not know."""
    kind, _ = _MIME.guess_type(key.rsplit("/", 1)[-1], strict=False)
    return kind or "application/octet-stream"


def _checked_metadata(metadata: Mapping[str, str]) -> Mapping[str, str]:
    for name, value in metadata.items():
        if not (name.isascii() and value.isascii() and name.isprintable() and value.isprintable()):
            raise ValueError(f"S3 metadata must be printable ASCII, got {name!r}: {value!r}")
    return metadata


def _version() -> str:
    from lingctl import __version__

    return __version__
