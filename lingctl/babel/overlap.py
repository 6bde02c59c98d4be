"""Whether two roots overlap: the same tree, or one inside the other.

A sync between overlapping roots destroys data or never converges: ``sync par/sub par --delete`` deletes
the source (its files are "missing" from the source's own subtree), and ``sync S S/copy`` copies the copy
into itself one level deeper on every run. Local roots are compared by their resolved real paths (links
and ``..`` cannot hide an overlap); S3 roots overlap when they share a bucket and one prefix contains the
other segment by segment (``s3://b/a`` and ``s3://b/ab`` are separate trees, ``s3://b/a`` and
``s3://b/a/x`` are not). A local root and an S3 root never overlap.
"""

from __future__ import annotations

import os

from lingctl.core.errors import UsageError
from lingctl.core.names import printable
from lingctl.core.storage.url import StoreURL


def _segments(url: StoreURL) -> tuple[str, ...]:
    """The root as path segments: the bucket then the prefix (S3), or the real path's parts (local)."""
    if url.is_s3:
        return (url.bucket, *(p for p in url.prefix.split("/") if p))
    # realpath resolves every link of the existing part and normalises the rest, so a destination that
    # does not exist yet still compares correctly with the source.
    real = os.path.realpath(os.path.abspath(url.path))
    return tuple(p for p in real.split(os.sep) if p)


def overlap(a: StoreURL, b: StoreURL) -> str | None:
    """How ``a`` relates to ``b`` when they overlap ("is the same as", "is inside", "contains"), else None."""
    if a.is_s3 != b.is_s3:
        return None
    sa, sb = _segments(a), _segments(b)
    if sa == sb:
        return "is the same as"
    if sa[: len(sb)] == sb:
        return "is inside"
    if sb[: len(sa)] == sa:
        return "contains"
    return None


def check_no_overlap(src: StoreURL, dst: StoreURL, *, allow_nested: bool = False) -> None:
    """``UsageError`` (exit 2) when ``src`` and ``dst`` overlap; ``allow_nested`` lets only identical roots
    fail (for read-only comparisons, where a tree inside another is harmless)."""
    how = overlap(src, dst)
    if how is None or (allow_nested and how != "is the same as"):
        return
    shown_src, shown_dst = printable(str(src)), printable(str(dst))
    if how == "is the same as":
        raise UsageError(
            f"source {shown_src} and destination {shown_dst} are the same tree",
            hint="give two different directories or prefixes",
        )
    raise UsageError(
        f"source {shown_src} {how} destination {shown_dst}: a sync between overlapping trees "
        "would copy into or delete its own source",
        hint="choose a source and a destination that do not contain each other",
    )
