"""Fast, parallel listing of whole trees: a local directory or everything under an S3 prefix.

Listing is what a sync of millions of objects waits on first. ``list_tree`` lists either kind of root on a
pool of workers and hands back batches while listing goes on, so a consumer can start comparing or copying
early; batches arrive in no particular order. Local trees are walked with ``os.scandir`` (this module); S3
prefixes are listed by ``s3_listing``.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator

from lingctl.babel.crawl import Crawl, Listed, ListStats, OnUnreadable, UnreadableError
from lingctl.babel.s3_listing import Range, S3Lister
from lingctl.core.atomic import is_tmp_name
from lingctl.core.errors import NotFoundError, UsageError, os_error
from lingctl.core.names import printable
from lingctl.core.storage.s3 import S3Options
from lingctl.core.storage.url import StoreURL, parse_url

log = logging.getLogger(__name__)

__all__ = ["Listed", "ListStats", "OnUnreadable", "UnreadableError", "list_tree"]

_BATCH = 1000  # local entries per batch; S3 batches are pages, which hold at most 1000 keys


def list_tree(url: StoreURL | str, s3: S3Options | None = None, *, jobs: int = 16, stats: ListStats | None = None,
              skip_dirs: frozenset[str] = frozenset(),
              on_unreadable: OnUnreadable | None = None) -> Iterator[list[Listed]]:
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
    stats = stats if stats is not None else ListStats()
    if root.is_s3:
        s3_lister = S3Lister(root, s3 or S3Options(), jobs, skip_dirs)
        return Crawl(jobs, stats, s3_lister.page, s3_lister.close, on_unreadable).run(Range(s3_lister.prefix))
    local = _LocalLister(root, skip_dirs)
    return Crawl(jobs, stats, local.scan, on_unreadable=on_unreadable).run((local.root, ""))


# -- local directories ------------------------------------------------------------------------------------


class _LocalLister:
    def __init__(self, url: StoreURL, skip_dirs: frozenset[str]) -> None:
        self.root = str(url.path)
        try:
            st = os.stat(self.root)  # follows a root that is itself a link, as the user meant
        except FileNotFoundError:
            raise NotFoundError(f"directory {self.root} does not exist") from None
        except OSError as exc:
            raise os_error(exc, self.root) from exc
        if not stat.S_ISDIR(st.st_mode):
            kind = "a file" if stat.S_ISREG(st.st_mode) else "neither a file nor a directory"
            raise UsageError(f"{self.root} is {kind}, not a directory", hint="give the directory that holds it")
        self.skip_dirs = skip_dirs
        # Symlinks to files are listed only when they resolve inside the real root: a sync must not copy
        # files from elsewhere on the machine just because a link points there.
        self._real_root = os.path.join(os.path.realpath(self.root), "")

    def scan(self, task: tuple[str, str], crawl: Crawl) -> None:
        directory, rel = task
        crawl.count(requests=1)
        try:
            it = os.scandir(directory)
        except FileNotFoundError:  # removed while the listing ran
            return
        except OSError as exc:
            if not rel:  # the root itself: nothing can be listed
                raise os_error(exc, directory) from exc
            crawl.unreadable(directory, os_error(exc, directory))
            return
        batch: list[Listed] = []
        with it:
            for entry in it:
                name = entry.name
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if name not in self.skip_dirs:
                            crawl.add((entry.path, f"{rel}{name}/"))
                        continue
                    if is_tmp_name(name):  # an unfinished atomic write of lingctl's
                        continue
                    if entry.is_symlink():
                        st = self._link_target(entry.path)
                        if st is None:
                            continue
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                    else:  # sockets, FIFOs, devices
                        continue
                except FileNotFoundError:
                    continue
                except OSError as exc:  # e.g. a directory that can be listed but not searched (mode r--)
                    crawl.unreadable(entry.path, os_error(exc, entry.path))
                    continue
                if not name.isascii() and not _utf8(name):
                    # A name that is not UTF-8 cannot become an S3 key (or a JSON line) as it is.
                    log.warning("skipping %s: its name is not valid UTF-8", os.fsencode(entry.path))
                    continue
                batch.append(Listed(rel + name, st.st_size, st.st_mtime))
                if len(batch) >= _BATCH:
                    crawl.emit(batch)
                    batch = []
        if batch:
            crawl.emit(batch)

    def _link_target(self, path: str) -> os.stat_result | None:
        """The stat of a symlink's target when it is a file inside the root; None (and a warning) otherwise."""
        target = os.path.realpath(path)
        if os.path.isdir(target):
            # Not followed: a link to a directory can form a loop or pull in a whole foreign tree.
            log.warning("not following symlinked directory %s", printable(path))
            return None
        if not os.path.isfile(target):
            log.warning("skipping broken symlink %s", printable(path))
            return None
        if not target.startswith(self._real_root):
            log.warning("skipping symlink %s: it points outside the source (%s)", printable(path),
                        printable(target))
            return None
        return os.stat(target)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.scandir keeps undecodable bytes as lone surrogates
        return False
    return True
