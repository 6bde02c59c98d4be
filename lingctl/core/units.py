"""Human sizes and durations in flags and output: ``64MiB``, ``1.5G``, ``10s``."""

from __future__ import annotations

import math
import re

from lingctl.core.errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
# rclone's duration units, minus the calendar ones (M, y, w) a training or sync deadline never needs; "ms" comes
# before "m" so that 500ms is not read as 500 minutes followed by a stray "s".
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(text: str | int) -> int:
    """Bytes from ``1234``, ``64M``/``64MiB`` (binary, as rclone reads them) or ``64MB`` (decimal)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise UsageError(f"invalid size {text!r}", hint="write a number of bytes or e.g. 64MiB, 1.5G, 500MB")
    number, unit, binary = m.groups()
    unit = unit.upper()
    explicit_decimal = unit and not binary and str(text).strip().upper().endswith("B")
    base = 1000 if explicit_decimal else 1024
    return int(float(number) * base ** _POWERS[unit])


def format_params(n: int) -> str:
    """A parameter count as the plans print it: ``16.80B``, ``18.24M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_duration(text: str) -> float:
    """Seconds from an rclone-style duration: ``500ms``, ``30s``, ``1m``, ``1h30m``, ``2d``; a bare number is
    seconds; ``0`` is 0. Raises ``ValueError`` naming ``text`` for an empty, negative or non-finite value."""
    s = text.strip().lower()
    # A sign is read off first, so "-30s" is called negative rather than malformed.
    negative = s.startswith("-")
    body = s[1:] if negative else s
    try:
        value = float(body)
    except ValueError:
        pos, value = 0, 0.0
        for m in _DURATION_RE.finditer(body):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(body) or not body:
            raise ValueError(f"invalid duration {text!r}") from None
    # float() takes "nan", "inf" and "1e999" too: none of them is a length of time.
    if not math.isfinite(value):
        raise ValueError(f"invalid duration {text!r}: not a finite number")
    if value < 0 or (negative and value > 0):
        raise ValueError(f"invalid duration {text!r}: must not be negative")
    return value


def format_duration(seconds: float) -> str:
    """A length of time as rclone writes an ETA: ``3725`` -> ``1h2m5s``, ``75`` -> ``1m15s``; under a minute,
    seconds with the precision that still means something (``2.35s``, ``12.3s``, ``42s``)."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        if seconds < 10:
            return f"{seconds:.2f}s"
        return f"{seconds:.1f}s" if seconds < 30 else f"{round(seconds)}s"
    whole = int(round(seconds))
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + f"{m}m{s}s"


def format_whole_duration(seconds: float) -> str:
    """Time left as rclone writes its ETA, in whole seconds: ``0s``, ``42s``, ``1m15s``, ``1h2m5s`` (a fraction of a
    second of an estimate means nothing, and log parsers expect the integer form)."""
    if not math.isfinite(seconds):
        return "-"
    whole = max(int(round(seconds)), 0)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"
