"""Parallel listing of a local directory tree: ``os.scandir`` on a crawl's worker pool, in batches.

The local half of ``ObjectStore.walk``. Symlinks to files are listed only when they resolve inside the
real root, symlinked directories are never followed, lingctl's own temporary files are never listed, and
a subdirectory that cannot be read is reported to the crawl (``Crawl.unreadable``) while the rest is listed.
"""

from __future__ import annotations

import logging
import os
import stat

from lingctl.core.atomic import is_tmp_name
from lingctl.core.errors import NotFoundError, UsageError, os_error
from lingctl.core.names import printable
from lingctl.core.storage.crawl import Crawl, Listed

log = logging.getLogger("lingctl.babel.listing")

_BATCH = 1000  # entries per batch; S3 batches are pages, which hold at most 1000 keys


class LocalLister:
    def __init__(self, root: str, skip_dirs: frozenset[str]) -> None:
        self.root = root
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
                listed = self._object(entry, rel, crawl)
                if listed is None:
                    continue
                batch.append(listed)
                if len(batch) >= _BATCH:
                    crawl.emit(batch)
                    batch = []
        if batch:
            crawl.emit(batch)

    def _object(self, entry: os.DirEntry[str], rel: str, crawl: Crawl) -> Listed | None:
        """The object ``entry`` (in directory ``rel``) is, or None when it is none: a subdirectory (added to
        the crawl), something skipped, or something unreadable (reported to the crawl)."""
        try:
            st = self._stat(entry, rel, crawl)
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. a directory that can be listed but not searched (mode r--)
            crawl.unreadable(entry.path, os_error(exc, entry.path))
            return None
        if st is None:
            return None
        if not entry.name.isascii() and not _utf8(entry.name):
            # A name that is not UTF-8 cannot become an S3 key (or a JSON line) as it is. It is not skipped
            # in silence: like an unreadable entry it fails the run (exit 1) and, since the listing is then
            # incomplete, a sync deletes nothing. rclone would encode it instead.
            crawl.unreadable(
                entry.path,
                UsageError(
                    f"{printable(entry.path)}: the name is not valid UTF-8, so it cannot be copied as a key",
                    hint="rename it (e.g. convmv -f latin1 -t utf8), or leave it out with --exclude",
                ),
            )
            return None
        return Listed(rel + entry.name, st.st_size, st.st_mtime)

    def _stat(self, entry: os.DirEntry[str], rel: str, crawl: Crawl) -> os.stat_result | None:
        """The stat of a file entry; None for the rest (a subdirectory is added to the crawl instead)."""
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in self.skip_dirs:
                crawl.add((entry.path, f"{rel}{entry.name}/"))
            return None
        if is_tmp_name(entry.name):  # an unfinished atomic write of lingctl's
            return None
        if entry.is_symlink():
            return self._link_target(entry.path)
        if entry.is_file(follow_symlinks=False):
            return entry.stat(follow_symlinks=False)
        return None  # sockets, FIFOs, devices

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
            log.warning("skipping symlink %s: it points outside the source (%s)", printable(path), printable(target))
            return None
        return os.stat(target)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.scandir keeps undecodable bytes as lone surrogates
        return False
    return True
