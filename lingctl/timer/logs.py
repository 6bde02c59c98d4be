"""Reading what ``install(out)`` wrote: ``rank-R.PID.meta.json`` and ``rank-R.PID.trace.zst``.

A trace log is a sequence of zstd frames, each the raw ring records (``ring.RECORD``, 32 bytes) that were new
when the tracer's background thread flushed. A process killed mid-write leaves a truncated last frame: what
it holds up to the last whole record is kept. Timestamps are the process's monotonic clock; the meta file's
``mono_anchor_ns``/``wall_anchor_ns`` put them on the wall clock.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lingctl.core.errors import NotFoundError, VerificationError
from lingctl.core.names import UnsafeNameError, join_under
from lingctl.timer.ring import MAX_GROUPS, RECORD, RECORD_SIZE, Record

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


# What a meta file must hold for diagnose and export to use it, as the tracer writes it: (field, required, check,
# what was expected). Numbers are JSON integers (not floats or booleans) in the range the ring header stores
# them in; a world is at most MAX_WORLD ranks (more than any job lingctl traces: diagnose lists missing ranks).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_WORLD = 1 << 20
MAX_META_BYTES = 16 << 20  # a meta file is about 1 KiB; the command line in it is bounded by the OS (ARG_MAX)


def _int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and lo <= v <= hi


def _groups(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(name, str) and type(i) is int and 0 <= i < MAX_GROUPS for name, i in v.items()
    )


META_RULES: tuple[tuple[str, bool, Callable[[Any], bool], str], ...] = (
    ("pid", True, _int_in(1, INT32_MAX), f"a process id (an integer from 1 to {INT32_MAX})"),
    ("rank", True, _int_in(0, MAX_WORLD - 1), f"a rank (an integer from 0 to {MAX_WORLD - 1})"),
    ("world", True, _int_in(1, MAX_WORLD), f"a world size (an integer from 1 to {MAX_WORLD})"),
    ("local_rank", False, _int_in(0, MAX_WORLD - 1), f"a local rank (an integer from 0 to {MAX_WORLD - 1})"),
    ("mono_anchor_ns", True, _int_in(0, INT64_MAX), "a clock reading in nanoseconds (an integer from 0 to 2**63-1)"),
    ("wall_anchor_ns", True, _int_in(0, INT64_MAX), "a clock reading in nanoseconds (an integer from 0 to 2**63-1)"),
    ("hostname", False, lambda v: v is None or isinstance(v, str), "a host name (a string)"),
    ("log", False, lambda v: isinstance(v, str), "the log's file name (a string)"),
    ("groups", False, _groups, f"an object of group name -> slot (an integer from 0 to {MAX_GROUPS - 1})"),
)


def meta_problem(meta: Any) -> str | None:
    """What makes ``meta`` something the tracer does not write (the first rule it breaks), or None."""
    if not isinstance(meta, dict):
        return f"not a JSON object (a JSON {_json_kind(meta)})"
    for field, required, ok, expected in META_RULES:
        if field not in meta:
            if required:
                return f"{field} is missing; expected {expected}"
        elif not ok(meta[field]):
            return f"{field} is {_shown(meta[field])}; expected {expected}"
    return None


def _json_kind(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(v), "null")


def _shown(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def read_meta(path: Path) -> dict:
    """One meta file; ``ValueError`` saying why when it is not one the tracer wrote (``meta_problem``)."""
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:  # a FIFO in its place cannot hang the open
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_META_BYTES:
            raise ValueError(f"{st.st_size} bytes, far more than a meta file holds")
        raw = f.read(MAX_META_BYTES + 1)
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, arrays nested thousands deep
        raise ValueError(f"not JSON lingctl writes ({str(exc).split(':')[0] or type(exc).__name__})") from None
    problem = meta_problem(meta)
    if problem is not None:
        raise ValueError(problem)
    return meta


def scan_runs(out: Path) -> tuple[list[dict], list[str]]:
    """Every traced process's metadata in ``out``, by rank then pid, each with ``meta_path`` and ``log_path``
    (absolute; the log may not exist yet, or at all for a process that never flushed); and, for each meta file
    that is not what the tracer writes, a line ``PATH: why`` (those files are left out)."""
    runs, skipped = [], []
    for path in sorted(Path(out).glob("rank-*.meta.json")):
        try:
            meta = read_meta(path)
            # The log's name comes from the file: it must stay inside the trace directory.
            log_file = join_under(path.parent, meta["log"], what="log") if meta.get("log") else None
        except (OSError, ValueError, UnsafeNameError) as exc:
            skipped.append(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")
            continue
        meta["meta_path"] = str(path.resolve())
        meta["log_path"] = str(log_file.resolve()) if log_file is not None else ""
        runs.append(meta)
    return sorted(runs, key=lambda m: (m["rank"], m["pid"])), skipped


def find_runs(out: Path) -> list[dict]:
    """``scan_runs``, with a warning for each meta file left out."""
    runs, skipped = scan_runs(out)
    for line in skipped:
        log.warning("skipping %s", line)
    return runs


def usable_runs(out: Path) -> tuple[list[dict], list[str]]:
    """``scan_runs`` for a command that needs at least one run, each file left out named once: a warning each
    when there are runs; else ``VerificationError`` (exit 4) naming the first, after a warning for each other.
    ``NotFoundError`` when ``out`` holds no meta file at all."""
    runs, skipped = scan_runs(out)
    for line in skipped if runs else skipped[1:]:
        log.warning("skipping %s", line)
    if runs:
        return runs, skipped
    if skipped:
        more = f" (and {len(skipped) - 1} more meta file(s) like it, above)" if len(skipped) > 1 else ""
        raise VerificationError(
            f"no usable traces: {skipped[0]}{more}",
            hint="these files are not what `lingctl timer` writes; remove them or trace the job again",
        )
    raise NotFoundError(
        f"{out}: no traces (rank-*.meta.json)", hint="trace a job with `lingctl timer run --out DIR -- CMD`"
    )
