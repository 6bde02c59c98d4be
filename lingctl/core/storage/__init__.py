"""Storage: URLs and the one object-store interface over local disks and S3-compatible stores."""

from __future__ import annotations

from lingctl.core.storage.base import MultipartUploads, ObjectInfo, ObjectStore, Version
from lingctl.core.storage.local import LocalStore
from lingctl.core.storage.retry import Aimd, RestartError, SourceChangedError, UploadGoneError
from lingctl.core.storage.s3.client import S3Options
from lingctl.core.storage.s3.store import S3Store
from lingctl.core.storage.url import StoreURL, check_key, parse_url


def open_store(url: str | StoreURL, s3: S3Options | None = None, *, gate: Aimd | None = None) -> ObjectStore:
    """The store rooted at ``url``: ``LocalStore`` for paths and file:// URLs, ``S3Store`` for s3://.
    ``gate``: the AIMD gate to share with other stores (S3 requests of one job adapt together)."""
    parsed = parse_url(url) if isinstance(url, str) else url
    if parsed.is_s3:
        return S3Store(parsed, s3, gate=gate)
    return LocalStore(parsed)


__all__ = [
    "Aimd",
    "LocalStore",
    "MultipartUploads",
    "ObjectInfo",
    "ObjectStore",
    "RestartError",
    "S3Options",
    "S3Store",
    "SourceChangedError",
    "StoreURL",
    "UploadGoneError",
    "Version",
    "check_key",
    "open_store",
    "parse_url",
]
