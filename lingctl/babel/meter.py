"""Running totals of a sync, fed by its progress callback and read by the progress bar or the stats lines.

``Meter`` is the ``Progress`` callback ``Syncer`` calls from many threads ("listed", "checked", "queued",
"copied", "bytes", "failed"); ``line`` renders one rclone-like stats line (binary units), as written to
stderr every ``--stats`` interval when stderr is not a terminal, so a sync under a batch scheduler logs.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

from lingctl.core.errors import UsageError
from lingctl.core.units import format_size

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from an rclone-style duration: ``1m``, ``30s``, ``500ms``, ``1h30m``; a bare number is
    seconds; ``0`` is 0 (off)."""
    s = text.strip().lower()
    try:
        value = float(s)
    except ValueError:
        pos, value = 0, 0.0
        for m in _DURATION_RE.finditer(s):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(s) or not s:
            raise UsageError(
                f"invalid duration {text!r}", hint="write e.g. 1m, 30s, 500ms, 1h30m, or 0 for off"
            ) from None
    if value < 0:
        raise UsageError(f"invalid duration {text!r}: must not be negative")
    return value


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h2m5s`` (rclone's way of writing an ETA)."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


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

    def describe(self) -> str:
        """The short text beside the progress bar."""
        return f"{self.copied} copied, {self.checked} checked, {self.listed} listed"

    def line(self, now: float | None = None) -> str:
        """One stats line: bytes done / queued so far, percent, rate, ETA, objects, errors, elapsed."""
        with self._lock:
            done, total, copied, checked, listed, errors = (
                self.done_bytes,
                self.queued_bytes,
                self.copied,
                self.checked,
                self.listed,
                self.errors,
            )
        elapsed = max((now if now is not None else time.monotonic()) - self.started, 1e-9)
        rate = done / elapsed
        percent = f"{100 * done // total}%" if total else "-"
        eta = format_duration((total - done) / rate) if rate > 0 and total >= done else "-"
        return (
            f"Transferred: {format_size(done)} / {format_size(total)}, {percent}, {format_size(rate)}/s, "
            f"ETA {eta}; objects: {copied} copied, {checked} checked, {listed} listed; errors: {errors}; "
            f"elapsed {format_duration(elapsed)}"
        )
