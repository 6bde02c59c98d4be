"""Fast, parallel listing of whole trees: a local directory or everything under an S3 prefix.

Listing is what a sync of millions of objects waits on first. ``list_tree`` lists either kind of root on a
pool of workers and hands back batches while listing goes on, so a consumer can start comparing or copying
early; batches arrive in no particular order. The listers themselves belong to the stores
(``ObjectStore.walk``: ``os.scandir`` on a thread pool for local trees, signed ListObjectsV2 requests split
over the key space for S3). ``list_entries`` is ``babel ls``: one level, or everything below, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from lingctl.core.errors import LingctlError, UsageError
from lingctl.core.storage import ObjectInfo, S3Options, StoreURL, open_store, parse_url
from lingctl.core.storage.crawl import Listed, ListStats, OnUnreadable, UnreadableError
from lingctl.core.storage.retry import Aimd

__all__ = ["Entries", "Listed", "ListStats", "OnUnreadable", "UnreadableError", "list_entries", "list_tree"]


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


@dataclass(kw_only=True, slots=True)
class Entries:
    """What ``list_entries`` found: the entries, and the count and total size of the objects among them."""

    entries: list[ObjectInfo] = field(default_factory=list)  # none when only counted
    objects: int = 0
    bytes: int = 0
    # Parts of a recursive listing that could not be read, left out (the caller reports them: exit 1).
    unreadable: list[tuple[str, LingctlError]] = field(default_factory=list)


def list_entries(
    url: StoreURL,
    s3: S3Options | None = None,
    *,
    recursive: bool = False,
    count_only: bool = False,
    jobs: int = 16,
    on_unreadable: OnUnreadable | None = None,
) -> Entries:
    """The objects and subdirectories directly in ``url``, in key order (a store's listing); ``recursive``:
    every object below it (``list_tree``), sorted by key; ``count_only`` (recursive too): only their count
    and size. A part of a recursive listing that cannot be read is passed to ``on_unreadable`` as it is
    met, kept in ``unreadable``, and the rest is listed."""
    if recursive or count_only:
        return _walk_entries(url, s3, count_only=count_only, jobs=jobs, on_unreadable=on_unreadable)
    found = Entries()
    store = open_store(url, s3)
    store.check()
    for info in store.list("", recursive=False):
        found.entries.append(info)
        if not info.is_dir:
            found.objects += 1
            found.bytes += info.size
    return found


def _walk_entries(
    url: StoreURL, s3: S3Options | None, *, count_only: bool, jobs: int, on_unreadable: OnUnreadable | None
) -> Entries:
    found = Entries()

    def skipped(path: str, err: LingctlError) -> None:
        if on_unreadable is not None:
            on_unreadable(path, err)
        found.unreadable.append((path, err))

    for batch in list_tree(url, s3, jobs=jobs, stats=ListStats(), on_unreadable=skipped):
        found.objects += len(batch)
        found.bytes += sum(e.size for e in batch)
        if not count_only:
            found.entries.extend(ObjectInfo(key=e.key, size=e.size, mtime=e.mtime, etag=e.etag) for e in batch)
    found.entries.sort(key=lambda e: e.key)
    return found
