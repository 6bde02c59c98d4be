"""Reading what ``install(out)`` wrote: ``rank-R.PID.meta.json`` and ``rank-R.PID.trace.zst``.

A trace log is a sequence of zstd frames, each the raw ring records (``ring.RECORD``, 32 bytes) that were new
when the tracer's background thread flushed. A process killed mid-write leaves a truncated last frame: what
it holds up to the last whole record is kept. Timestamps are the process's monotonic clock; the meta file's
``mono_anchor_ns``/``wall_anchor_ns`` put them on the wall clock.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lingctl.core.names import UnsafeNameError, join_under
from lingctl.timer.ring import RECORD, RECORD_SIZE, Record

log = logging.getLogger("lingctl.timer")


def read_log(path: Path) -> list[Record]:
    import zstandard

    data = Path(path).read_bytes()
    dctx = zstandard.ZstdDecompressor()
    raw = bytearray()
    while data:
        obj = dctx.decompressobj()
        try:
            raw += obj.decompress(data)
        except zstandard.ZstdError:
            break
        if not obj.eof:  # truncated last frame
            break
        data = obj.unused_data
    usable = len(raw) - len(raw) % RECORD_SIZE
    return [Record(*fields) for fields in RECORD.iter_unpack(memoryview(raw)[:usable])]


def read_meta(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def find_runs(out: Path) -> list[dict]:
    """Every traced process's metadata in ``out``, by rank then pid, each with ``meta_path`` and ``log_path``
    (absolute; the log may not exist yet, or at all for a process that never flushed)."""
    runs = []
    for path in Path(out).glob("rank-*.meta.json"):
        try:
            meta = read_meta(path)
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
            # The log's name comes from the file: it must stay inside the trace directory.
            log_file = join_under(path.parent, meta["log"], what=f"{path.name}: log") if meta.get("log") else None
        except (OSError, ValueError, UnsafeNameError) as exc:
            log.warning("skipping %s: %s", path, exc)
            continue
        meta["meta_path"] = str(path.resolve())
        meta["log_path"] = str(log_file.resolve()) if log_file is not None else ""
        runs.append(meta)
    return sorted(runs, key=lambda m: (m.get("rank", 0), m.get("pid", 0)))
