"""Storage: URLs and the object-store interface over local disks and S3-compatible stores."""

from __future__ import annotations

from lingctl.core.storage.base import ObjectInfo, ObjectStore
from lingctl.core.storage.local import LocalStore
from lingctl.core.storage.s3 import S3Options, S3Store
from lingctl.core.storage.url import StoreURL, check_key, parse_url


def open_store(url: str | StoreURL, s3: S3Options | None = None) -> ObjectStore:
    """The store rooted at ``url``: ``LocalStore`` for paths and file:// URLs, ``S3Store`` for s3://."""
    parsed = parse_url(url) if isinstance(url, str) else url
    if parsed.is_s3:
        return S3Store(parsed, s3)
    return LocalStore(parsed)


__all__ = ["ObjectInfo", "ObjectStore", "LocalStore", "S3Options", "S3Store", "StoreURL", "check_key", "open_store",
           "parse_url"]
