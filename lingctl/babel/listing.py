"""Fast, parallel listing of whole trees: a local directory or everything under an S3 prefix.

Listing is what a sync of millions of objects waits on first. ``list_tree`` lists either kind of root on a
pool of workers and hands back batches while listing goes on, so a consumer can start comparing or copying
early; batches arrive in no particular order. The listers themselves belong to the stores
(``ObjectStore.walk``: ``os.scandir`` on a thread pool for local trees, signed ListObjectsV2 requests split
over the key space for S3).
"""

from __future__ import annotations

from collections.abc import Iterator

from lingctl.core.errors import UsageError
from lingctl.core.storage import S3Options, StoreURL, open_store, parse_url
from lingctl.core.storage.crawl import Listed, ListStats, OnUnreadable, UnreadableError
from lingctl.core.storage.retry import Aimd

__all__ = ["Listed", "ListStats", "OnUnreadable", "UnreadableError", "list_tree"]


def list_tree(
    url: StoreURL | str,
    s3: S3Options | None = None,
    *,
    jobs: int = 16,
    stats: ListStats | None = None,
    skip_dirs: frozenset[str] = frozenset(),
    on_unreadable: OnUnreadable | None = None,
    gate: Aimd | None = None,
) -> Iterator[list[Listed]]:
    """Every object under url (recursively), in batches, in no particular order.

    The root is checked (and S3 credentials resolved) at once; listing starts on the first ``next()``.
    Directories (local) or common prefixes (S3) named in ``skip_dirs`` are skipped at any depth. Raises
    ``NotFoundError`` (no such directory or bucket), ``AccessDeniedError``, ``UsageError`` (the root is a
    file, bad options) and, once its retries are spent, ``RetryableError``. Stopping the iteration early
    stops the workers.

    A local subdirectory (or entry) that cannot be read is logged and left out, and the rest is listed:
    ``on_unreadable(path, error)`` is called for it, or, without a handler, ``UnreadableError`` (exit 1)
    is raised after the last batch. lingctl's own temporary files (``core.atomic.is_tmp_name``: exactly
    the names it makes, not every name holding the marker) are never listed.
    """
    root = parse_url(url) if isinstance(url, str) else url
    if jobs < 1:
        raise UsageError(f"jobs must be >= 1, got {jobs}")
    store = open_store(root, s3, gate=gate)
    return store.walk(jobs=jobs, stats=stats, skip_dirs=skip_dirs, on_unreadable=on_unreadable)
