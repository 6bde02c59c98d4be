"""Human sizes and durations in flags and output: ``64MiB``, ``1.5G``, ``10s``."""

from __future__ import annotations

import re

from lingctl.core.errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


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


def format_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
