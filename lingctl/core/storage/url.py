"""Storage URLs: ``PATH``, ``file://PATH`` and ``s3://bucket/prefix``; endpoint URLs; object keys.

A URL names a *root*: a local directory or a bucket plus a key prefix treated as a directory (as rclone
does), so ``s3://b/data`` and ``s3://b/data/`` are the same root and hold the key ``x`` at ``data/x``.

Endpoint URLs may carry secrets a user pasted into them (``http://user:password@host``, a presigned
query): every URL that is shown, in errors, logs or reports, goes through ``redact_url`` first. Text a
server sent (an error message, which may echo the signed request back) goes through ``redact_secrets``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from lingctl.core.errors import UsageError
from lingctl.core.names import UnsafeNameError, check_relative, printable

# S3's own rules, loosened to allow upper case and underscores, which some S3-compatible stores accept.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]$")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HINT = "use a local path, file://PATH or s3://bucket/prefix"
# user:password@ after "scheme://" (not s3:// or file://, where an '@' belongs to a bucket, key or path):
# everything up to the last '@' before whitespace, '?' or '#', so a password holding '/' or '@' is covered.
_USERINFO_RE = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s?#]*@)")
_NO_USERINFO_SCHEMES = frozenset({"s3", "s3a", "file"})
# Query parameters whose values are secrets: presigned S3 URLs (X-Amz-Signature, X-Amz-Credential,
# X-Amz-Security-Token, Signature, AWSAccessKeyId) and the usual password/token names.
_SECRET_PARAM_RE = re.compile(
    r"([?&;])([^=&#\s]*(?:sig|token|secret|passw|pwd|credential|key|auth)[^=&#\s]*)=([^&#\s]*)", re.IGNORECASE
)
REDACTED = "***"
# Credentials as they appear in a signed request, which a server may echo back in an error: the whole value
# of an Authorization header (SigV4 "AWS4-HMAC-SHA256 Credential=..., Signature=...", SigV2 "AWS key:sig",
# anything else), and the named fields of presigned URLs and SigV4 headers wherever they appear.
_AUTHORIZATION_RE = re.compile(r"(?i)(\bauthorization\b[\"']?\s*[:=]\s*[\"']?)([^\r\n<>\"']+)")
_SIGV4_RE = re.compile(r"AWS4-HMAC-SHA256\s[^\r\n<>\"']*")
_SIGV2_RE = re.compile(r"\bAWS [A-Za-z0-9]{16,128}:[A-Za-z0-9+/=]{20,}")
_AUTH_FIELD_RE = re.compile(
    r"(?i)\b(x-amz-signature|x-amz-credential|x-amz-security-token|signature|credential|awsaccesskeyid)"
    r"([\"']?\s*[:=]\s*[\"']?)([^\s,&;\"'<>]+)"
)
# Secrets lingctl itself signs with (the secret key, the session token): never shown, wherever they appear.
_KNOWN_SECRETS: set[str] = set()


@dataclass(frozen=True, slots=True)
class StoreURL:
    scheme: str  # "file" or "s3"
    bucket: str = ""  # s3 only
    prefix: str = ""  # s3: key prefix without leading/trailing "/"; file: the directory path

    @property
    def is_s3(self) -> bool:
        return self.scheme == "s3"

    @property
    def path(self) -> Path:
        if self.is_s3:
            raise ValueError("an s3:// URL has no local path")
        return Path(self.prefix)

    def join(self, key: str) -> StoreURL:
        """The URL of ``key`` below this root (for messages and for opening a sub-root)."""
        key = key.strip("/")
        if not key:
            return self
        if self.is_s3:
            return StoreURL("s3", self.bucket, f"{self.prefix}/{key}" if self.prefix else key)
        return StoreURL("file", prefix=str(Path(self.prefix) / key))

    def __str__(self) -> str:
        if self.is_s3:
            return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return self.prefix


def parse_url(text: str) -> StoreURL:
    """Parse a user's URL or path; raise ``UsageError`` naming the problem for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("empty storage URL", hint=_HINT)
    text = text.strip()
    m = _SCHEME_RE.match(text)
    if m is None:
        return StoreURL("file", prefix=str(Path(text).expanduser()))
    scheme = m.group(1).lower()
    rest = text[m.end() :]
    if scheme == "file":
        if not rest:
            raise UsageError(f"no path in {text!r}", hint=_HINT)
        return StoreURL("file", prefix=str(Path(rest).expanduser()))
    if scheme in ("s3", "s3a"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UsageError(f"no bucket in {text!r}", hint="write s3://bucket or s3://bucket/prefix")
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise UsageError(
                f"invalid bucket name {bucket!r} in {text!r}",
                hint="bucket names are 3-63 letters, digits, '.', '-' or '_', starting and ending with a letter or digit",
            )
        prefix = prefix.strip("/")
        if "//" in prefix:
            raise UsageError(f"empty path segment in {text!r}")
        return StoreURL("s3", bucket, prefix)
    raise UsageError(f"unsupported URL scheme {scheme!r} in {text!r}", hint=_HINT)


class InvalidKeyError(UnsafeNameError, UsageError):
    """A key that cannot name an object in a store. A usage error when a caller asked for it; when it came
    from data (a listing being copied) it fails that object like any other data that does not verify, so
    its exit code is 4 (``UnsafeNameError``'s), and nothing is written through it."""


def check_key(key: str) -> str:
    """A key relative to a root, by ``lingctl.core.names.check_relative``'s rules: '/'-separated, no empty,
    '.' or '..' segments, no control characters, segments short enough to be file names. So a key cannot
    escape its root, on disk or in a mirror of it. A ``UsageError``: here keys are what a caller asked for."""
    try:
        return check_relative(key, what="invalid object key")
    except UnsafeNameError as exc:
        raise UsageError(exc.message, hint="keys are relative names like 'dir/file'") from None


def check_object_key(key: str) -> str:
    """A key for an object store: '/'-separated, no leading or trailing '/', no empty, '.' or '..' segments
    (so it cannot leave its root), but any other character S3 takes. ``InvalidKeyError`` otherwise."""
    if not isinstance(key, str) or not key or any(seg in ("", ".", "..") for seg in key.split("/")):
        raise InvalidKeyError(
            f"invalid object key {printable(str(key))!r}", hint="keys are relative names like 'dir/file'"
        )
    return key


def add_secret(secret: str | None) -> None:
    """Remember a credential lingctl uses (a secret key, a session token), so ``redact_secrets`` removes it
    from any text, however a server quotes it."""
    if secret and len(secret) >= 8:  # a short one would blank out ordinary words
        _KNOWN_SECRETS.add(secret)


def redact_secrets(text: str) -> str:
    """``text`` with credentials replaced by ``***``: Authorization header values, SigV4/SigV2 signatures,
    ``X-Amz-Signature``/``-Credential``/``-Security-Token`` and ``Signature``/``Credential`` fields, and
    the secrets registered with ``add_secret``."""
    text = _SIGV4_RE.sub(f"AWS4-HMAC-SHA256 {REDACTED}", text)
    text = _SIGV2_RE.sub(f"AWS {REDACTED}", text)
    text = _AUTHORIZATION_RE.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    text = _AUTH_FIELD_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    for secret in list(_KNOWN_SECRETS):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def server_words(text: str, limit: int = 200) -> str:
    """Text a server sent (an error code or message), fit to show: redacted, then cut to ``limit``
    characters (in that order, so no secret cut in two escapes redaction)."""
    return redact_secrets(text[: 16 * limit])[:limit]


def redact_url(text: str) -> str:
    """``text`` (a URL, or a message holding URLs) with user:password, secret query values and credentials
    (``redact_secrets``) replaced by ``***``, and control characters escaped: safe to show on a terminal, in
    a log or in a JSON report."""

    def userinfo(m: re.Match[str]) -> str:
        scheme = m.group(1)[:-3].lower()
        return m.group(0) if scheme in _NO_USERINFO_SCHEMES else f"{m.group(1)}{REDACTED}@"

    text = _USERINFO_RE.sub(userinfo, text)
    text = _SECRET_PARAM_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}", text)
    return printable(redact_secrets(text))


def check_endpoint_url(text: str) -> str:
    """An S3 endpoint as ``http(s)://host[:port][/path]`` (no trailing '/'), else a one-line ``UsageError``
    that shows the URL redacted. User info is dropped: S3 requests are signed with the AWS credentials,
    so a user:password in the URL is never used, and a URL without it cannot leak it later."""
    # An endpoint takes no query or fragment, and what people paste there is a presigned URL or a token:
    # shown without any of it.
    bare = text.split("?", 1)[0].split("#", 1)[0]
    shown = redact_url(bare) + (f"?{REDACTED}" if bare != text else "")
    hint = "write it as http(s)://host[:port], e.g. http://127.0.0.1:9000"
    if any(ch.isspace() or not ch.isprintable() for ch in text):
        raise UsageError(f"invalid endpoint URL {shown!r}: it holds spaces or control characters", hint=hint)
    try:
        parts = urlsplit(text)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed or out-of-range port
    except ValueError:  # an unclosed '[', a port that is not a number: the reason may quote part of a password
        raise UsageError(f"invalid endpoint URL {shown!r}: malformed host or port", hint=hint) from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise UsageError(f"invalid endpoint URL {shown!r}", hint=hint)
    if bare != text:
        raise UsageError(f"invalid endpoint URL {shown!r}: an S3 endpoint takes no query or fragment", hint=hint)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")
