"""Emulated per-node write bandwidth, shared by every process of a node.

Benchmarks and tests run all "nodes" on one machine, where every process writes to the same disk at the
same speed. To measure what a plan does on nodes whose disks differ, each emulated node gets one pipe of a
given bandwidth: a writer reserves the next free interval of its node's pipe (``bytes / bandwidth`` long)
in a small shared file under an exclusive lock, and sleeps until the end of that interval. Writers of one
node therefore share its bandwidth first come first served, as they would share a real disk, and writers
of different nodes do not interfere.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

_FORMAT = "d"  # the time (CLOCK_MONOTONIC, seconds) at which the node's pipe is next free


class NodeThrottle:
    """Limit the writes of every process that opens the same ``path`` to ``bytes_per_s`` together."""

    def __init__(self, path: Path | str, bytes_per_s: float, *, depth: int = 4 << 20) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s}")
        self.path = Path(path)
        self.bytes_per_s = float(bytes_per_s)
        self.depth_s = depth / self.bytes_per_s
        self._last_end = 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.waited_s = 0.0

    def consume(self, nbytes: int) -> None:
        """Account for ``nbytes`` written now; return when the pipe has room again (or, with depth 0, when
        it has carried them)."""
        if nbytes > 0:
            self._sleep_until(self.reserve(nbytes) - self.depth_s)

    def reserve(self, nbytes: int) -> float:
        """Book the next ``nbytes / bandwidth`` of the pipe; return when that interval ends (no waiting)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(self._fd, 8, 0)
            free_at = struct.unpack(_FORMAT, raw)[0] if len(raw) == 8 else 0.0
            now = time.monotonic()
            end = max(now, free_at) + nbytes / self.bytes_per_s
            os.pwrite(self._fd, struct.pack(_FORMAT, end), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._last_end = end
        return end

    def drain(self) -> None:
        """Wait until every byte this writer accounted for has gone through the pipe (an fsync)."""
        self._sleep_until(self._last_end)

    def _sleep_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            self.waited_s += delay
            time.sleep(delay)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __getstate__(self) -> dict:
        return {"path": str(self.path), "bytes_per_s": self.bytes_per_s, "depth": self.depth_s * self.bytes_per_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["bytes_per_s"], depth=int(state["depth"]))  # type: ignore[misc]


class Throttles:
    """Pipes a write goes through together, e.g. its node's disk and the rank's own stream (a per-stream
    limit of a network filesystem or object store): bytes are through when the slowest pipe has carried
    them."""

    def __init__(self, *pipes: NodeThrottle) -> None:
        self.pipes = pipes

    def consume(self, nbytes: int) -> None:
        if nbytes > 0 and self.pipes:
            ends = [p.reserve(nbytes) - p.depth_s for p in self.pipes]
            self.pipes[0]._sleep_until(max(ends))

    def drain(self) -> None:
        for p in self.pipes:
            p.drain()

    def close(self) -> None:
        for p in self.pipes:
            p.close()
