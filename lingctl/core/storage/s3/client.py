"""S3 clients and errors: options, a boto3 client built from them (imported only when used), and the
mapping of boto3/botocore failures onto lingctl's error kinds.

Endpoint, credentials and region follow the standard AWS chain: ``--endpoint-url`` or ``AWS_ENDPOINT_URL``
(``AWS_ENDPOINT_URL_S3``), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` and the shared config files. Secrets never appear in messages: errors name the endpoint,
bucket and key only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lingctl.core.errors import (
    AccessDeniedError,
    CertificateError,
    LingctlError,
    NotFoundError,
    RetryableError,
    UsageError,
    VerificationError,
)
from lingctl.core.storage.retry import THROTTLE_CODES, THROTTLE_STATUS
from lingctl.core.storage.url import check_endpoint_url, redact_secrets, server_words

log = logging.getLogger(__name__)

# Replies worth sending again: throttling (the one list, shared with the retrier) and transient server errors.
RETRY_CODES = THROTTLE_CODES | {"RequestTimeout", "InternalError"}
_MiB = 1 << 20
_GiB = 1 << 30
# Time bounds of every request (docs/storage.md, "Bounds on every request"). Connecting: 10 s covers three
# lost SYNs (1 + 2 + 4 s) while a dead endpoint is still found, and retried, quickly (rclone's --contimeout
# is 1 m, for every kind of backend).
DEFAULT_CONNECT_TIMEOUT = 10.0
# The idle timeout: the longest wait for any byte, rclone's --timeout (5 m there). 60 s is botocore's read
# timeout; S3 answers in well under a second, and keeps a long CompleteMultipartUpload alive with spaces.
DEFAULT_READ_TIMEOUT = 60.0


@dataclass(kw_only=True, slots=True)
class S3Options:
    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS itself
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / profile, else us-east-1
    profile: str | None = None  # None: AWS_PROFILE / default
    # Path-style addressing (http://host/bucket/key). None: on for custom endpoints, which rarely have
    # wildcard DNS for virtual-host buckets, and off for AWS itself.
    path_style: bool | None = None
    max_attempts: int = 3  # attempts per request, first included (retry.Retrier: throttling, 5xx, connections)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT  # the idle timeout
    # An answer slower than this many bytes/s on average over a read_timeout window is cut (curl's
    # --speed-limit with --speed-time = the idle timeout): far below any working link, far above a trickle
    # meant to hold the request open. 0: off.
    low_speed_limit: int = 1024
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
        for name, seconds in (("connect_timeout", self.connect_timeout), ("read_timeout", self.read_timeout)):
            if not seconds > 0 or seconds == float("inf"):
                raise UsageError(f"{name} must be a positive number of seconds, got {seconds}")
        if self.low_speed_limit < 0:
            raise UsageError(f"low_speed_limit must be >= 0 bytes/s, got {self.low_speed_limit}")


def make_client(options: S3Options, *, unsigned: bool = False, attempts: int | None = None) -> Any:
    """A boto3 S3 client for ``options``; raises ``UsageError`` for a bad endpoint, profile or region.

    ``unsigned`` sends anonymous requests (public buckets, or checking that an endpoint answers at all).
    ``attempts``: botocore's own attempts per request (default ``options.max_attempts``); the stores pass 1,
    since their ``Retrier`` must see every failure to adapt concurrency."""
    options.validate()
    import boto3
    import botocore
    import botocore.config
    import botocore.exceptions

    endpoint = options.resolved_endpoint()
    try:
        session = boto3.session.Session(profile_name=options.profile)
    except botocore.exceptions.ProfileNotFound:
        raise profile_not_found(options.profile) from None
    region = options.region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
    path_style = options.path_style if options.path_style is not None else endpoint is not None
    config = botocore.config.Config(
        region_name=region,
        s3={"addressing_style": "path" if path_style else "auto"},
        # total_max_attempts counts the first try; botocore's max_attempts would count only the retries.
        retries={"total_max_attempts": attempts or options.max_attempts, "mode": "standard"},
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


def profile_not_found(profile: str | None) -> UsageError:
    return UsageError(f"AWS profile {profile!r} not found", hint="check ~/.aws/config or AWS_PROFILE")


def translate(exc: BaseException, what: str, endpoint: str, attempts: int) -> LingctlError:
    """Map a boto3/botocore exception on ``what`` (bucket/key) to a lingctl error kind, without secrets."""
    import botocore.exceptions as bx

    where = endpoint or "AWS S3"
    if isinstance(exc, CertificateError):
        return exc
    if isinstance(exc, bx.ClientError):
        return _reply_error(exc.response, what, where, attempts)
    if isinstance(exc, bx.SSLError) and (cert := _certificate_failure(exc)) is not None:
        return certificate_error(where, cert)
    if isinstance(
        exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError, bx.ConnectionClosedError)
    ):
        return _no_answer(exc, what, where, attempts)
    if isinstance(exc, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)):
        # A connection that broke mid-request or mid-body (reset, truncated stream): a new request can work.
        return RetryableError(
            f"connection to S3 endpoint {where} broke during {what} after {attempts} attempt(s) ({type(exc).__name__})"
        )
    return _client_side_error(exc, what, where)


def _no_answer(exc: Any, what: str, where: str, attempts: int) -> RetryableError:
    # lingctl's own clients say what went wrong (``error``, a string) and whether the server was reached.
    detail = exc.kwargs.get("error")
    detail = redact_secrets(detail) if isinstance(detail, str) else type(exc).__name__
    if exc.kwargs.get("reached"):
        return RetryableError(
            f"no complete answer from S3 endpoint {where} for {what} after {attempts} attempt(s): {detail}",
            hint="if it keeps failing, the server (or a proxy on the way) is broken; --timeout sets the idle timeout",
        )
    return RetryableError(
        f"could not reach S3 endpoint {where} after {attempts} attempt(s) ({detail})",
        hint="check --endpoint-url / AWS_ENDPOINT_URL and that the server is running",
    )


def _client_side_error(exc: BaseException, what: str, where: str) -> LingctlError:
    """botocore's own failures, before or after any answer: credentials, a checksum it checked, the rest."""
    import botocore.exceptions as bx

    if isinstance(exc, bx.NoCredentialsError):
        return AccessDeniedError(
            f"no S3 credentials found for {where}",
            hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
        )
    if isinstance(exc, bx.PartialCredentialsError):
        return AccessDeniedError(
            f"incomplete S3 credentials: {exc}", hint="set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(exc, bx.FlexibleChecksumError):  # botocore checked S3's own checksum field on a GET
        return VerificationError(
            f"checksum mismatch for {what} at {where}: {exc}", hint="the stored object is damaged; nothing was written"
        )
    if isinstance(exc, bx.BotoCoreError):
        return LingctlError(f"S3 error on {what} at {where}: {server_words(str(exc), 500)}")
    raise exc


_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
    }
)
# The body arrived different from what was sent (its MD5 or checksum did not match): sending it again can
# work, and nothing was stored.
_DIGEST_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "BadChecksum"})

# What an error answer means, as (does it match: (code, status, what), the error: (what, where, code)); the
# first that matches wins. "Not found" is decided by the status and code, never by the message's words.
_ReplyRule = tuple[Callable[[str, int, str], bool], Callable[[str, str, str], LingctlError]]
_REPLY_RULES: tuple[_ReplyRule, ...] = (
    # HeadBucket answers a bare 404 without a code; ``what`` is then the bucket name alone.
    (
        lambda code, status, what: code == "NoSuchBucket" or (status == 404 and "/" not in what),
        lambda what, where, code: NotFoundError(f"bucket {what.split('/')[0]!r} does not exist at {where}"),
    ),
    (
        lambda code, status, what: code == "NoSuchUpload",
        lambda what, where, code: NotFoundError(
            f"{what}: the multipart upload no longer exists at {where} (aborted, or the server restarted)",
            hint="run the same command again to start a new upload",
        ),
    ),
    (
        lambda code, status, what: code == "PreconditionFailed" or status == 412,
        lambda what, where, code: RetryableError(f"{what}: the object changed at {where} while it was being read"),
    ),
    (
        lambda code, status, what: code in ("NoSuchKey", "NotFound", "404") or status == 404,
        lambda what, where, code: NotFoundError(f"{what}: not found at {where}"),
    ),
    (
        lambda code, status, what: code in _CREDENTIAL_CODES,
        lambda what, where, code: AccessDeniedError(
            f"S3 rejected the credentials for {what} at {where} ({code})",
            hint="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
        ),
    ),
    (
        lambda code, status, what: code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403,
        lambda what, where, code: AccessDeniedError(
            f"access denied to {what} at {where}", hint="check the credentials' permissions"
        ),
    ),
    (
        lambda code, status, what: code in _DIGEST_CODES,
        lambda what, where, code: RetryableError(
            f"{what}: the server received different bytes than were sent at {where} ({code})"
        ),
    ),
    (
        lambda code, status, what: code == "InvalidRange" or status == 416,
        lambda what, where, code: UsageError(f"{what}: requested range is outside the object"),
    ),
)


def _reply_error(response: dict[str, Any], what: str, where: str, attempts: int) -> LingctlError:
    """The error for an S3 error answer (a botocore ``ClientError``'s ``response``)."""
    err = response.get("Error", {})
    code = str(err.get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    for matches, error in _REPLY_RULES:
        if matches(code, status, what):
            return error(what, where, code)
    # The server's words are data: shortened, and cleared of anything that looks like a credential.
    message = server_words(str(err.get("Message") or code))
    shown_code = server_words(code)
    if status >= 500 or status in THROTTLE_STATUS or code in RETRY_CODES:
        return RetryableError(f"S3 error on {what} at {where} after {attempts} attempt(s): {shown_code}: {message}")
    return LingctlError(f"S3 error on {what} at {where}: {shown_code}: {message}")


def repeated_token_error(endpoint: str, what: str) -> LingctlError:
    """A listing whose server hands back a continuation token it already gave: it would never end, and
    asking again gets the same answer (exit 1)."""
    from lingctl.core.names import printable

    return LingctlError(
        f"S3 endpoint {endpoint or 'AWS S3'} repeats a continuation token when listing {printable(what)}: "
        "the listing would never end",
        hint="the server is broken, or something on the way to it rewrites its answers",
    )


def certificate_error(where: str, cert: Any) -> CertificateError:
    """The error for a TLS certificate that failed verification (``cert``: the ``ssl`` error)."""
    reason = getattr(cert, "verify_message", None) or getattr(cert, "reason", None) or "not trusted"
    return CertificateError(
        f"the TLS certificate of S3 endpoint {where} failed verification ({reason}); nothing was sent",
        hint="for a private CA, point AWS_CA_BUNDLE at its certificate (a PEM file); "
        "check that --endpoint-url names the host the certificate is for",
    )


def _certificate_failure(exc: BaseException) -> Any:
    from lingctl.core.storage.s3.http_wire import certificate_failure

    return certificate_failure(exc)


def ca_bundle() -> str | None:
    """The CA bundle for https endpoints: ``AWS_CA_BUNDLE``, else botocore's (certifi's), as boto3 uses."""
    if os.environ.get("AWS_CA_BUNDLE"):
        return os.environ["AWS_CA_BUNDLE"]
    from botocore.httpsession import get_cert_path

    return get_cert_path(True)
