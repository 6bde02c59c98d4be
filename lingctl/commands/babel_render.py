"""Human and JSON output of ``lingctl babel``, written from the library's records: listings (``Entries``), the
live progress of a copy or sync (the meter's ``Totals``: the words beside the progress bar, rclone-like
stats lines), and the results of a sync (``SyncResult``) and a verify (``VerifyResult``). The library counts;
this module writes.

Keys and paths come from data (listings of trees other people wrote): every one shown in human output goes
through ``printable``, and every endpoint through ``redact_url``. JSON output keeps keys exact (JSON escapes
control characters itself).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lingctl.babel.meter import Meter, Totals
from lingctl.core.names import printable
from lingctl.core.output import Output, to_jsonable
from lingctl.core.storage.url import redact_url
from lingctl.core.units import format_duration, format_size, format_whole_duration

if TYPE_CHECKING:
    from lingctl.babel.listing import Entries
    from lingctl.babel.sync import Progress, SyncResult
    from lingctl.babel.verify import VerifyResult
    from lingctl.core.storage import ObjectInfo


def progress_text(t: Totals) -> str:
    """The short text beside the progress bar."""
    return f"{t.copied} copied, {t.checked} checked, {t.listed} listed"


def stats_line(t: Totals) -> str:
    """One stats line: bytes done / queued so far, percent, rate, ETA, objects, errors, elapsed."""
    done, total = t.done_bytes, t.queued_bytes
    elapsed = max(t.elapsed_s, 1e-9)
    rate = done / elapsed
    percent = f"{100 * done // total}%" if total else "-"
    eta = format_whole_duration((total - done) / rate) if rate > 0 and total >= done else "-"
    return (
        f"Transferred: {format_size(done)} / {format_size(total)}, {percent}, {format_size(rate)}/s, "
        f"ETA {eta}; objects: {t.copied} copied, {t.checked} checked, {t.listed} listed; errors: {t.errors}; "
        f"elapsed {format_duration(elapsed)}"
    )


@contextmanager
def live_progress(out: Output, *, stats_every: float, force: bool) -> Iterator[Progress]:
    """The progress callback of a running copy or sync: a progress bar on a terminal (or, with ``force``,
    anywhere), else a stats line on stderr every ``stats_every`` seconds (0: none)."""
    meter = Meter()
    live = force or out.progress_enabled
    # Off a terminal nothing is drawn, so a log gets a stats line every --stats interval instead.
    lines = stats_every if not live and not out.stderr_is_terminal else 0.0
    with (
        out.progress("syncing", total=0, unit="bytes", binary_units=True, force=force) as bar,
        out.stats_lines(lines, lambda: stats_line(meter.totals())),
    ):

        def on_progress(kind: str, n: int) -> None:
            meter(kind, n)
            if kind == "queued":
                bar.update(total=meter.queued_bytes)
            elif kind == "bytes":
                bar.advance(n)
            elif kind in ("copied", "checked", "listed"):
                bar.update(description=progress_text(meter.totals()))

        yield on_progress


def show_entries(out: Output, url: str, found: Entries, *, recursive: bool, summary: bool) -> None:
    """``babel ls``: the count and total size (``summary``), or a line per entry."""
    if summary:
        count, total = found.objects, found.bytes
        out.result(
            {"url": url, "objects": count, "bytes": total}, f"{count} objects, {format_size(total)} ({total} bytes)"
        )
        return
    rows = [_listed_row(e) if recursive else _dir_row(e) for e in found.entries]

    def human(console: Any) -> None:
        for r in rows:
            when = dt.datetime.fromtimestamp(r["mtime"]).strftime("%Y-%m-%d %H:%M:%S") if r.get("mtime") else " " * 19
            console.print(f"{r['size']:>14} {when} {printable(r['key'])}", markup=False)

    out.result(rows, human)


def _listed_row(e: ObjectInfo) -> dict[str, Any]:
    return {"key": e.key, "size": e.size, "mtime": e.mtime, "etag": e.etag}


def _dir_row(e: ObjectInfo) -> dict[str, Any]:
    return {
        "key": e.key + ("/" if e.is_dir else ""),
        "size": e.size,
        "mtime": e.mtime if not e.is_dir else None,
        "etag": e.etag,
        "is_dir": e.is_dir,
        "checksum": e.checksum,
    }


def show_sync(out: Output, r: SyncResult) -> None:
    """The result of a copy or sync: what was (or, in a dry run, would be) copied and deleted, failures, and
    one summary line."""
    r.source, r.destination = redact_url(r.source), redact_url(r.destination)

    def human(console: Any) -> None:
        if r.dry_run:
            for key in r.would_copy:
                console.print(f"would copy  {printable(key)}", markup=False)
            for key in r.would_delete:
                console.print(f"would delete {printable(key)}", markup=False)
        for f in r.failed:
            console.print(f"FAILED {printable(f['key'])}: {printable(redact_url(f['error']))}", markup=False)
        console.print(_sync_summary(r), markup=False)
        if r.deletes_skipped:
            console.print(r.deletes_skipped, markup=False)

    out.result(to_jsonable(r), human)


def _sync_summary(r: SyncResult) -> str:
    verb = "would copy" if r.dry_run else "copied"
    n, size = (len(r.would_copy), r.would_copy_bytes) if r.dry_run else (r.copied, r.copied_bytes)
    return (
        f"{verb} {n} objects ({format_size(size)}), {r.skipped} up to date, "
        f"{r.deleted if not r.dry_run else len(r.would_delete)} "
        f"{'deleted' if not r.dry_run else 'to delete'}, {len(r.failed)} failed; "
        f"listed {r.listed_source} + {r.listed_destination} objects in {r.list_requests} requests; "
        f"{r.retries} retries; {r.seconds:.1f} s"
    )


def show_verify(out: Output, result: VerifyResult) -> None:
    """Every difference with both sides' figures, then one summary line."""
    result.source, result.destination = redact_url(result.source), redact_url(result.destination)

    def human(console: Any) -> None:
        for d in result.differences:
            sides = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items() if k not in ("key", "problem"))
            console.print(f"DIFFERS {printable(d['key'])}: {d['problem']} ({sides})", markup=False)
        console.print(
            f"{result.checked} objects compared ({result.mode}), {result.matched} match, "
            f"{len(result.differences)} differ; {result.seconds:.1f} s",
            markup=False,
        )

    out.result({**to_jsonable(result), "ok": result.ok}, human)
