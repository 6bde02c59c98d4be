"""Running totals of a sync, fed by its progress callback and read by the progress bar or the stats lines.

``Meter`` is the ``Progress`` callback ``Syncer`` calls from many threads ("listed", "checked", "queued",
"copied", "bytes", "failed"); ``totals`` is a consistent copy of the counts at one moment, which
``lingctl.commands.babel_render`` writes as rclone-like stats lines (every ``--stats`` interval when stderr is
not a terminal, so a sync under a batch scheduler logs).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from lingctl.core.units import parse_duration as parse_duration  # --stats is read with it; kept importable here


@dataclass(frozen=True, slots=True)
class Totals:
    """The counts at one moment, read together under the meter's lock."""

    listed: int
    checked: int
    queued: int
    queued_bytes: int
    copied: int
    done_bytes: int
    errors: int
    elapsed_s: float


@dataclass(slots=True)
class Meter:
    started: float = field(default_factory=time.monotonic)
    listed: int = 0
    checked: int = 0  # source objects compared with the destination (copied or found up to date)
    queued: int = 0
    queued_bytes: int = 0
    copied: int = 0
    done_bytes: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, kind: str, n: int) -> None:
        with self._lock:
            if kind == "listed":
                self.listed += n
            elif kind == "checked":
                self.checked += n
            elif kind == "queued":
                self.queued += 1
                self.queued_bytes += n
            elif kind == "copied":
                self.copied += n
            elif kind == "bytes":
                self.done_bytes += n
            elif kind == "failed":
                self.errors += n

    def totals(self, now: float | None = None) -> Totals:
        """The counts at ``now`` (a ``time.monotonic()`` reading; default: the clock now)."""
        with self._lock:
            return Totals(
                listed=self.listed,
                checked=self.checked,
                queued=self.queued,
                queued_bytes=self.queued_bytes,
                copied=self.copied,
                done_bytes=self.done_bytes,
                errors=self.errors,
                elapsed_s=(now if now is not None else time.monotonic()) - self.started,
            )
