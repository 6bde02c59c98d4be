"""What lingctl records with an S3 object, and the one parser that reads it back from a HEAD or GET reply.

Metadata written with every object (S3 lower-cases user metadata names; some servers keep the sender's case):

- ``lingctl-crc64nvme``: the CRC64NVME of the source bytes, base64 of its 8 big-endian bytes;
- ``lingctl-mtime``: the source's modification time, seconds since the epoch (Python ``repr`` of the float);
- ``mtime``: the same time in rclone's own key and format (seconds with nine decimals, as rclone's S3 backend
  writes ``X-Amz-Meta-Mtime``), so ``rclone lsl`` shows the source's time and ``rclone copy`` sees the object
  as up to date.

Read back, the mtime is lingctl's key, else rclone's, else the store's ``LastModified``; the checksum is
lingctl's key (computed from the source bytes at upload), else S3's own full-object CRC64NVME field.
"""

from __future__ import annotations

import math
from typing import Any

from lingctl.core.checksum import tag_from_b64
from lingctl.core.errors import LingctlError
from lingctl.core.names import printable
from lingctl.core.storage.base import ObjectInfo

CHECKSUM_META = "lingctl-crc64nvme"
MTIME_META = "lingctl-mtime"
RCLONE_MTIME_META = "mtime"


def rclone_time(mtime: float, mtime_ns: int | None = None) -> str:
    """A time as rclone writes it: whole seconds, '.', nine digits of nanoseconds (exact from ``mtime_ns``)."""
    ns = mtime_ns if mtime_ns is not None else round(mtime * 1e9)
    sec, frac = divmod(ns, 10**9)
    return f"{sec}.{frac:09d}"


def object_metadata(
    *, mtime: float | None = None, mtime_ns: int | None = None, crc: str | None = None
) -> dict[str, str]:
    """The user metadata that records ``mtime`` (source modification time; ``mtime_ns`` the same to the
    nanosecond, when known) and ``crc`` (a tagged CRC64NVME)."""
    meta: dict[str, str] = {}
    if crc is not None:
        meta[CHECKSUM_META] = crc.split(":", 1)[1]
    if mtime is not None:
        meta[MTIME_META] = repr(float(mtime))
        meta[RCLONE_MTIME_META] = rclone_time(mtime, mtime_ns)
    return meta


def _seconds(text: str | None) -> float | None:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def unquoted_etag(value: str | None) -> str | None:
    """An ETag as lingctl keeps it: without S3's quotes, None when there is none."""
    return (value or "").strip('"') or None


def parse_reply(key: str, reply: dict[str, Any]) -> ObjectInfo:
    """Size, mtime, checksum and ETag of ``key`` from a HeadObject (or GetObject) reply. A reply without
    its size or date (a broken server) is a one-line ``LingctlError``."""
    if not isinstance(reply.get("ContentLength"), int) or not hasattr(reply.get("LastModified"), "timestamp"):
        raise LingctlError(f"{printable(key)}: the server's answer lacks the object's size or date")
    meta = {k.lower(): v for k, v in (reply.get("Metadata") or {}).items()}
    mtime = _seconds(meta.get(MTIME_META))
    if mtime is None:
        mtime = _seconds(meta.get(RCLONE_MTIME_META))
    if mtime is None:
        mtime = reply["LastModified"].timestamp()
    b64 = meta.get(CHECKSUM_META)
    if not b64 and reply.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
        b64 = reply.get("ChecksumCRC64NVME")  # a composite multipart CRC ("...-N") is not comparable
    return ObjectInfo(
        key=key,
        size=int(reply["ContentLength"]),
        mtime=mtime,
        checksum=tag_from_b64(b64) if b64 else None,
        etag=unquoted_etag(reply.get("ETag")),
    )
