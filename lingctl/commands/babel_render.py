"""Human text for a running ``lingctl babel sync``: the words beside the progress bar and rclone-like stats
lines, drawn from the meter's ``Totals`` (the library counts; this module writes)."""

from __future__ import annotations

from lingctl.babel.meter import Totals
from lingctl.core.units import format_duration, format_size


def progress_text(t: Totals) -> str:
    """The short text beside the progress bar."""
    return f"{t.copied} copied, {t.checked} checked, {t.listed} listed"


def stats_line(t: Totals) -> str:
    """One stats line: bytes done / queued so far, percent, rate, ETA, objects, errors, elapsed."""
    done, total = t.done_bytes, t.queued_bytes
    elapsed = max(t.elapsed_s, 1e-9)
    rate = done / elapsed
    percent = f"{100 * done // total}%" if total else "-"
    eta = format_duration((total - done) / rate) if rate > 0 and total >= done else "-"
    return (
        f"Transferred: {format_size(done)} / {format_size(total)}, {percent}, {format_size(rate)}/s, "
        f"ETA {eta}; objects: {t.copied} copied, {t.checked} checked, {t.listed} listed; errors: {t.errors}; "
        f"elapsed {format_duration(elapsed)}"
    )
