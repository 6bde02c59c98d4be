"""S3's answers as lingctl reads them, whichever client sent the request: an error answer as an exception of
botocore's types (so ``translate()`` and the throttle checks classify it), no complete answer as a connection
error, and an object's headers as the fields of boto3's HeadObject/GetObject reply, so one reply parser
(``metadata.parse_reply``) serves both clients.

Importing this module imports botocore's exception classes (not its signer or session).
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any

import botocore.exceptions

from lingctl.core.storage.s3 import http_wire
from lingctl.core.storage.url import server_words

Headers = Mapping[str, str]  # case-insensitive (http_wire.Headers, or urllib3's HTTPHeaderDict via an https proxy)

META_PREFIX = "x-amz-meta-"
_CODE_RE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]*)</Message>")
_EMPTY_HEADERS = http_wire.Headers()
_REPLY_HEADERS = (
    ("ContentLength", "Content-Length"),
    ("ETag", "ETag"),
    ("LastModified", "Last-Modified"),
    ("ChecksumCRC64NVME", "x-amz-checksum-crc64nvme"),
    ("ChecksumType", "x-amz-checksum-type"),
    ("ContentRange", "Content-Range"),
)


class S3HTTPError(botocore.exceptions.ClientError):
    """An error answer from S3: HTTP ``status``, S3 error ``code`` and ``message``."""

    def __init__(
        self,
        *,
        status: int,
        code: str,
        message: str,
        operation: str,
        key: str,
        request_id: str | None = None,
        headers: Headers = _EMPTY_HEADERS,
    ) -> None:
        super().__init__(
            {
                "Error": {"Code": code, "Message": message},
                "ResponseMetadata": {
                    "HTTPStatusCode": status,
                    "RequestId": request_id or "",
                    "HTTPHeaders": {k.lower(): v for k, v in headers.items()},
                },
            },
            operation,
        )
        self.status = status
        self.code = code
        self.message = message
        self.key = key
        self.request_id = request_id
        self.headers = headers

    def __reduce__(self) -> Any:  # ClientError's own would call __init__ with botocore's arguments
        return _rebuild_http_error, (
            self.status,
            self.code,
            self.message,
            self.operation_name,
            self.key,
            self.request_id,
        )


def _rebuild_http_error(
    status: int, code: str, message: str, operation: str, key: str, request_id: str | None
) -> S3HTTPError:
    return S3HTTPError(status=status, code=code, message=message, operation=operation, key=key, request_id=request_id)


class S3ConnectionError(botocore.exceptions.EndpointConnectionError):
    """No complete answer from ``endpoint_url``: ``error`` names what happened (refused, reset, timeout,
    a body shorter than its Content-Length). Retryable; the request may or may not have taken effect."""

    fmt = 'No complete answer from the endpoint URL "{endpoint_url}": {error}'


def user_metadata(headers: Headers) -> dict[str, str]:
    """The object's user metadata from a GET or HEAD answer: ``x-amz-meta-NAME`` as ``{name: value}``,
    names lower-cased (AWS lower-cases them; some servers keep the sender's case)."""
    cut = len(META_PREFIX)
    return {name[cut:].lower(): value for name, value in headers.items() if name.lower().startswith(META_PREFIX)}


def as_reply(headers: Headers, *, operation: str = "GetObject", key: str = "", whole: bool = False) -> dict[str, Any]:
    """The fields of a boto3 HeadObject/GetObject reply that lingctl reads (``ContentLength``, ``ETag``,
    ``LastModified`` as an aware datetime, ``Metadata``, ``ChecksumCRC64NVME``, ``ChecksumType``,
    ``ContentRange``), built from raw answer headers, so one reply parser serves both clients.

    A header that cannot mean what it should (a size that is not a number, a date that is not one) is an
    ``S3HTTPError`` with code ``MalformedReply``, as is, with ``whole``, a missing size or date (the fields
    a HEAD must carry): one line naming the header, never a traceback."""
    reply: dict[str, Any] = {"Metadata": user_metadata(headers)}
    for field, header in _REPLY_HEADERS:
        value = headers.get(header)
        if value is not None:
            reply[field] = value

    def malformed(what: str) -> S3HTTPError:
        return S3HTTPError(status=200, code="MalformedReply", message=what, operation=operation, key=key)

    if "ContentLength" in reply:
        try:
            reply["ContentLength"] = http_wire.content_length(reply["ContentLength"])
        except http_wire.WireError as exc:
            raise malformed(str(exc)) from None
    if "LastModified" in reply:
        try:
            modified = parsedate_to_datetime(reply["LastModified"])
        except (TypeError, ValueError, IndexError):
            modified = None
        if modified is None:
            raise malformed(f"malformed Last-Modified {reply['LastModified'][:40]!r}")
        # RFC 2822's "-0000" (zone unknown) parses without a zone; HTTP dates are GMT.
        reply["LastModified"] = modified if modified.tzinfo else modified.replace(tzinfo=timezone.utc)
    if whole and ("ContentLength" not in reply or "LastModified" not in reply):
        raise malformed("the answer lacks Content-Length or Last-Modified")
    return reply


def http_error(resp: Any, operation: str, key: str, *, status: int | None = None) -> S3HTTPError:
    text = resp.data.decode("utf-8", errors="replace") if resp.data else ""
    code_m, message_m = _CODE_RE.search(text), _MESSAGE_RE.search(text)
    status = status or resp.status
    # What the server says is data: shortened, and cleared of anything that looks like a credential (a
    # server may echo the request's Authorization header back).
    code = server_words(html.unescape(code_m.group(1))) if code_m else str(status)
    message = server_words(html.unescape(message_m.group(1)) if message_m else (resp.reason or code))
    return S3HTTPError(
        status=status,
        code=code,
        message=message,
        operation=operation,
        key=key,
        request_id=resp.headers.get("x-amz-request-id"),
        headers=resp.headers,
    )


def describe_wire(exc: http_wire.WireError) -> str:
    """What went wrong in words, e.g. "Connection reset by peer" or "read timed out"."""
    cause = exc.cause
    if isinstance(cause, OSError) and cause.strerror and cause.strerror != exc.what:
        return f"{exc.what} ({cause.strerror})"
    return exc.what
