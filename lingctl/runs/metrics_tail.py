"""``RUN/metrics.jsonl`` followed while a job writes it: what the launcher needs to judge a hang and a recovery.

Read incrementally (only the bytes added since the last look); a line still being written waits for its
newline, and a line without a whole-number step is passed over silently (the launcher polls a live file, and
needs only steps, step times and save times). The file is rewritten (a new file under the same
name) when a restarted run drops the records after its checkpoint: it is then read again from its start.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from lingctl.core.jsonl import BadLine, parse_json
from lingctl.runs.records import is_int, is_number


class MetricsTail:
    """Step times, save times, the last step, and the first step record written after a given moment."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""
        self.steps: dict[int, tuple[float | None, float | None]] = {}  # step -> (step_s, wall time)
        self.longest_save_s: float | None = None

    def poll(self) -> None:
        with self._lock:
            try:
                st = os.stat(self.path)
            except OSError:
                return
            if st.st_ino != self._inode or st.st_size < self._offset:
                self._inode, self._offset, self._partial = st.st_ino, 0, b""
                self.steps = {}
            if st.st_size == self._offset:
                return
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read(st.st_size - self._offset)
            except OSError:
                return
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()  # a line still being written
            for line in lines:
                self._take(line)

    def _take(self, line: bytes) -> None:
        try:
            record = parse_json(line, nan=True)
        except BadLine:
            return
        if not isinstance(record, dict) or not is_int(record.get("step")):
            return
        if record.get("event") == "step":
            self.steps[record["step"]] = (_number(record.get("step_s")), _number(record.get("time")))
        elif record.get("event") == "checkpoint":
            save = _number(record.get("save_s"))
            if save is not None:
                self.longest_save_s = max(self.longest_save_s or 0.0, save)

    def step_times(self) -> list[float]:
        with self._lock:
            return [s for _, (s, _) in sorted(self.steps.items()) if s is not None]

    def last_step(self) -> int | None:
        with self._lock:
            return max(self.steps, default=None)

    def first_step_since(self, wall: float) -> tuple[int, float] | None:
        """The earliest step record written at or after Unix time ``wall``: (step, time)."""
        with self._lock:
            later = [(t, s) for s, (_, t) in self.steps.items() if t is not None and t >= wall]
        if not later:
            return None
        t, s = min(later)
        return s, t


def _number(value: Any) -> float | None:
    return float(value) if is_number(value) else None
