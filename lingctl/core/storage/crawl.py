"""Listings as streams of batches: the per-object record, counters, and the worker pool that produces them.

Both listers (local directories, S3 prefixes) are crawls whose tasks add more tasks (a directory its
subdirectories, a prefix its sub-prefixes and key ranges); results go to the consumer through a bounded
queue while the crawl goes on.

A part of the tree that cannot be read (a subdirectory without permission) does not stop the crawl: it is
reported to the consumer's ``on_unreadable`` and everything else is listed. A consumer that passes no
handler gets an ``UnreadableError`` after the last batch, so a partial listing is never taken for a whole
one (a sync with --delete must not delete what it could not see in the source).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lingctl.core.errors import LingctlError
from lingctl.core.names import printable
from lingctl.core.storage.retry import Counters

log = logging.getLogger("lingctl.babel.listing")


@dataclass(slots=True)
class Listed:
    key: str  # relative to the root URL's prefix, '/'-separated
    size: int
    mtime: float  # seconds since the epoch (S3 LastModified, or local st_mtime)
    etag: str | None = None


@dataclass(slots=True)
class ListStats(Counters):
    """A listing's counts. Its ``Counters``: the List requests sent, retries included, as an S3 listing's
    ``Retrier`` counts them (for a local tree, ``requests`` is the directories scanned)."""

    objects: int = 0
    unreadable: int = 0  # directories (or entries) that could not be read and were left out


# on_unreadable(path, error naming it), called on the consumer's thread, never on a listing worker.
OnUnreadable = Callable[[str, LingctlError], None]


class UnreadableError(LingctlError):
    """Some directories could not be read; everything else was listed (exit 1: retrying will not help)."""

    def __init__(self, failures: list[tuple[str, LingctlError]]) -> None:
        _, err = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(
            f"{len(failures)} {'entry' if len(failures) == 1 else 'entries'} could not be listed, "
            f"so the listing is incomplete; first: {printable(err.message)}{more}",
            hint=err.hint or "fix their permissions and run the same command again; the rest was handled",
        )
        self.failures = failures


@dataclass(slots=True)
class _Unreadable:
    path: str
    error: LingctlError


class Crawl:
    """Worker threads whose tasks may add more tasks; batches come back through a bounded queue.

    The bound is backpressure: a consumer slower than the listing holds the workers instead of memory.
    The workers are daemon threads, unlike a ThreadPoolExecutor's: a listing abandoned without close()
    (its generator kept alive by a traceback) must not hold up the interpreter's exit.
    """

    _DONE = object()

    def __init__(
        self,
        jobs: int,
        stats: ListStats,
        work: Callable[[Any, Crawl], None],
        close: Callable[[], None] | None = None,
        on_unreadable: OnUnreadable | None = None,
    ) -> None:
        self.jobs = jobs
        self._on_unreadable = on_unreadable
        self.stats = stats
        self._work = work
        self._close = close
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out: queue.Queue[Any] = queue.Queue(maxsize=4 * jobs)
        self._lock = threading.Lock()
        self.pending = 0  # tasks added and not finished; the listing is over when it drops to 0
        self.stopped = threading.Event()

    def add(self, task: Any) -> None:
        if not self.stopped.is_set():
            with self._lock:
                self.pending += 1
            self._tasks.put(task)

    def emit(self, batch: list[Listed]) -> None:
        self._put(batch)

    def unreadable(self, path: str, error: LingctlError) -> None:
        """A directory or entry left out because it cannot be read; the crawl goes on with the rest.
        A consumer's ``on_unreadable`` reports it; without one it is logged here (the message names it)."""
        if self._on_unreadable is None:
            log.warning("cannot read %s; listing the rest", printable(error.message))
        self._put(_Unreadable(path, error))

    def count(self, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.stats.requests += requests
            self.stats.retries += retries

    def _put(self, item: Any) -> None:
        while not self.stopped.is_set():
            try:
                self._out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _worker(self) -> None:
        while (task := self._tasks.get()) is not None and not self.stopped.is_set():
            try:
                self._work(task, self)
            except BaseException as exc:  # handed to the consumer's thread, which raises it
                self._put(exc)
            finally:
                with self._lock:
                    self.pending -= 1
                    done = self.pending == 0
                if done:
                    self._put(self._DONE)

    def run(self, first: Any) -> Iterator[list[Listed]]:
        workers = [
            threading.Thread(target=self._worker, name=f"lingctl-list-{i}", daemon=True) for i in range(self.jobs)
        ]
        for w in workers:
            w.start()
        failures: list[tuple[str, LingctlError]] = []
        try:
            self.add(first)
            while True:
                item = self._out.get()
                if item is self._DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Unreadable):
                    self.stats.unreadable += 1
                    if self._on_unreadable is not None:
                        self._on_unreadable(item.path, item.error)
                    else:
                        failures.append((item.path, item.error))
                    continue
                self.stats.objects += len(item)
                yield item
        finally:
            # Also reached when the consumer stops early: queued tasks are dropped, running ones finish
            # their current request or directory and exit.
            self.stopped.set()
            for _ in workers:
                self._tasks.put(None)
            for w in workers:
                w.join()
            if self._close is not None:
                self._close()
            log.debug(
                "listing done: %d objects, %d requests, %d retries",
                self.stats.objects,
                self.stats.requests,
                self.stats.retries,
            )
        if failures:
            raise UnreadableError(failures)
