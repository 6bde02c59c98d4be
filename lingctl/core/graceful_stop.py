"""Ctrl-C and SIGTERM for long jobs: the first asks the job to stop at its next safe point (finish the step,
write what it must, exit), the second aborts at once.

A batch scheduler sends SIGTERM before it kills a job (Slurm, Kubernetes); torchrun forwards it to its
workers. Both are handled alike, so a preempted job stops as cleanly as an interrupted one. Until the job
says it has reached the part that can stop cleanly (:meth:`GracefulStop.arm`), a signal aborts at once:
there is nothing to save during start-up, and a user should not wait for it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """``stop()`` is True once a stop was requested; pass it to the job as its ``should_stop``.
    ``on_request`` runs once, at the first request (to say what happens next)."""

    def __init__(self, on_request: Callable[[], None] | None = None, *, armed: bool = True) -> None:
        self.requested = False
        self.armed = armed
        self._on_request = on_request or (lambda: None)

    def __call__(self) -> bool:
        return self.requested

    def arm(self) -> None:
        """From now on the first signal is a request, not an abort."""
        self.armed = True

    def request(self) -> None:
        """Ask for a stop (what the first signal does; also for callers that stop for other reasons)."""
        if not self.requested:
            self.requested = True
            self._on_request()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested or not self.armed:
            raise KeyboardInterrupt
        self.request()


@contextmanager
def graceful_stop(stop: GracefulStop) -> Iterator[GracefulStop]:
    """SIGINT and SIGTERM go to ``stop`` for the ``with`` block; the previous handlers come back after it.
    Outside the main thread, where Python cannot install handlers, signals keep their previous handling."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, stop._on_signal)
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
