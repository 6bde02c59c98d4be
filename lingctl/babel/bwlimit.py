"""``--bwlimit``: one token bucket shared by every transfer thread of a run.

The rate is read as rclone reads it: bytes per second in binary units, a bare number meaning KiB/s
(``10M`` = 10 MiB/s, ``512`` = 512 KiB/s), ``0`` or ``off`` for no limit. Threads charge the bytes they
moved (``take``) and sleep until the bucket has paid for them, so the total over all threads keeps to the
rate. The bucket holds at most one second of tokens: a pause (a slow listing, a verify) lets the next
second go at most twice the rate, never a burst of everything saved up.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from lingctl.core.errors import UsageError

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([BKMGTP]?)(?:i?B)?\s*$", re.IGNORECASE)
_POWERS = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_rate(text: str) -> float:
    """Bytes per second from an rclone-style ``--bwlimit`` value; 0 means no limit."""
    if text.strip().lower() in ("off", "0", ""):
        return 0.0
    m = _RATE_RE.match(text)
    if m is None:
        raise UsageError(
            f"invalid --bwlimit {text!r}",
            hint="write a rate in bytes per second with a binary suffix, e.g. 10M (10 MiB/s), "
            "512K, 1.5G, or 0/off for no limit; a bare number means KiB/s, as in rclone",
        )
    number, unit = m.groups()
    return float(number) * 1024 ** _POWERS[(unit or "K").upper()]


class TokenBucket:
    """Blocks callers so that the bytes charged by all threads together flow at ``rate`` bytes/s."""

    def __init__(
        self, rate: float, *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = rate
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = 0.0  # starts empty: the first second goes at the rate too
        self._stamp = clock()
        self.waited = 0.0  # seconds callers were held back, for the run's report

    def take(self, n: int) -> None:
        """Charge ``n`` bytes; returns once they are paid for. Large charges (a whole part) are paid by a
        sleep of n / rate: the tokens may go negative, and later callers wait for the debt as well."""
        if n <= 0:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited += wait
        if wait > 0:
            self._sleep(wait)
