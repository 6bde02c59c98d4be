"""GPU time of forward and backward, from a fixed pool of CUDA event pairs that the tracer reuses."""

from __future__ import annotations

from collections import deque
from typing import Any

from lingctl.timer.ring import NO_GROUP, Kind, RingWriter


class GpuTimer:
    """GPU time of forward and backward, kept simple: a fixed pool of CUDA event pairs recorded on the current
    stream around the call, polled with ``query()`` (never a synchronize) by the background thread. Spans are
    not timed before the program has initialised CUDA, while a CUDA graph is captured, or when all pairs are
    in flight."""

    def __init__(self, cuda: Any, size: int = 64) -> None:
        self.cuda, self.size = cuda, size
        self.free: list | None = None
        self.pending: deque = deque()

    def begin(self) -> Any:
        cuda = self.cuda
        if not cuda.is_initialized() or cuda.is_current_stream_capturing():
            return None
        if self.free is None:
            self.free = [(cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)) for _ in range(self.size)]
        if not self.free:
            return None
        pair = self.free.pop()
        pair[0].record()
        return pair

    def end(self, pair: Any, kind: int, seq: int, start_ns: int) -> None:
        pair[1].record()
        self.pending.append((pair, kind, seq, start_ns))

    def poll(self, writer: RingWriter) -> None:
        free = self.free
        if free is None:  # nothing timed yet: begin() creates the events
            return
        while self.pending and self.pending[0][0][1].query():
            (a, b), kind, seq, start_ns = self.pending.popleft()
            gpu_ns = int(a.elapsed_time(b) * 1e6)
            free.append((a, b))
            writer.append(Kind.GPU, 0, NO_GROUP, seq, start_ns, start_ns + gpu_ns, kind)
