"""Storage URLs: ``PATH``, ``file://PATH`` and ``s3://bucket/prefix``.

A URL names a *root*: a local directory or a bucket plus a key prefix treated as a directory (as rclone
does), so ``s3://b/data`` and ``s3://b/data/`` are the same root and hold the key ``x`` at ``data/x``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.errors import UsageError

# S3's own rules, loosened to allow upper case and underscores, which some S3-compatible stores accept.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]$")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HINT = "use a local path, file://PATH or s3://bucket/prefix"


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

    def join(self, key: str) -> "StoreURL":
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
    rest = text[m.end():]
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


def check_key(key: str) -> str:
    """A key relative to a root: '/'-separated, no empty, '.' or '..' segments, so it cannot escape the root."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise UsageError(f"invalid object key {key!r}: keys are relative names like 'dir/file'")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UsageError(f"invalid object key {key!r}: empty, '.' or '..' segments are not allowed")
    if "\x00" in key:
        raise UsageError("invalid object key: contains a NUL byte")
    return key
