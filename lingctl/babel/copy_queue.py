"""The copies of a sync waiting for, or running on, a thread pool."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lingctl.babel.transfer import Item


class CopyQueue:
    """Copies handed to a pool. The listing runs ahead of copying by at most ``4 * jobs`` objects, not
    unboundedly, and finished futures are dropped as it goes: a huge sync must not keep one per object."""

    def __init__(self, pool: ThreadPoolExecutor, jobs: int) -> None:
        self._pool = pool
        self._jobs = jobs
        self._window = threading.BoundedSemaphore(jobs * 4)
        self._futures: list[Future[Any]] = []

    def submit(self, copy: Callable[[Item], None], item: Item) -> None:
        self._window.acquire()
        fut = self._pool.submit(copy, item)
        fut.add_done_callback(lambda _f: self._window.release())
        self._futures.append(fut)
        if len(self._futures) > 8 * self._jobs:
            self._futures = self._reap()

    def wait(self) -> None:
        """Wait for every copy, re-raising any unexpected error (expected ones are recorded by the copy)."""
        for fut in self._futures:
            fut.result()

    def _reap(self) -> list[Future[Any]]:
        """Drop finished futures, re-raising any unexpected error."""
        pending = []
        for fut in self._futures:
            if fut.done():
                fut.result()
            else:
                pending.append(fut)
        return pending
