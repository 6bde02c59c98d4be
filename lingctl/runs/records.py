"""``RUN/metrics.jsonl`` (and ``incidents.jsonl``, written the same way) read back: the records, each checked
for the field types its readers use before any of them sees it.

A running job appends to the file while others read it: ``train status``, ``train plot``, the curves drawn at
the end of a run, ``--resume`` (which cuts the file back to its checkpoint) and the launcher. A reader meets
two kinds of line that are not a good record:

- a **torn last line** (no newline after it, not JSON): the writer was killed in the middle of it, or is
  still writing it. Skipped silently, as a reader of a live file must.
- a **bad line** anywhere else: not JSON, not an object, or a field of another type than lingctl writes
  (``"step": "x"``, ``"loss": "NaN"`` as text, a step of 1e400). Skipped with a warning naming FILE:LINE,
  and the rest of the file is read. This is what TensorBoard does with a corrupt event record: it warns and
  goes on, so one damaged line never hides a run's history, and never stops ``--resume``, which keeps the
  line as it is (it may be somebody's note; lingctl deletes nothing it cannot read) and trains on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import NotFoundError, os_error
from lingctl.core.jsonl import BadLine, parse_json

log = logging.getLogger(__name__)

Record = dict[str, Any]
Check = Callable[[Record], "str | None"]  # why a record is not one lingctl writes; None when it is

LIMIT = 2**63  # integers beyond int64 are not counts lingctl writes (and overflow float conversions)


def is_int(value: Any, *, least: int = 0) -> bool:
    """A whole number in ``least`` .. 2**63 - 1 (a bool is not one, though JSON's true is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < LIMIT


def is_number(value: Any) -> bool:
    """A JSON number that converts to a float. NaN and infinity are allowed: lingctl writes them as the loss
    of a spike that was not applied (``NaN``, as Python's json writes it)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and -LIMIT < value < LIMIT)


# Fields of every record (when present), then the fields an event must have (its readers index them).
_COMMON = {"step": is_int, "time": is_number, "tokens": is_int}
_REQUIRED = {
    "step": ("step", "loss", "lr", "tokens", "tokens_per_s"),
    "eval": ("step", "eval_loss"),
    "checkpoint": ("step",),
}
_NUMBERS = ("loss", "lr", "tokens_per_s", "step_s", "eval_loss", "save_s", "grad_norm")


def check_record(record: Record) -> str | None:
    """Why ``record`` is not a metrics record as lingctl writes it; None when it is."""
    event = record.get("event")
    if not isinstance(event, str):
        return f"event is {_kind(event)}, not text"
    for key in _REQUIRED.get(event, ()):
        if key not in record:
            return f"a {event} record without {key}"
    for key, ok in _COMMON.items():
        if key in record and not ok(record[key]):
            return f"{key} is {_kind(record[key])}, not a whole number" if ok is is_int else f"{key} is not a number"
    if event in _REQUIRED:
        for key in _NUMBERS:
            if key in record and record[key] is not None and not is_number(record[key]):
                return f"{key} is {_kind(record[key])}, not a number"
    loads = record.get("expert_load")
    if loads is not None and not (
        isinstance(loads, list) and all(isinstance(x, dict) and is_number(x.get("cv")) for x in loads)
    ):
        return "expert_load is not a list of per-layer figures"
    return None


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # from 1, as editors count
    raw: bytes  # the line as it is in the file, without its newline
    record: Record | None  # None: not a good record
    why: str | None  # why not (None for a good record, and for a torn last line)

    @property
    def text(self) -> str:
        return self.raw.decode("utf-8", errors="replace")


def lines(data: bytes, check: Check = check_record) -> list[Line]:
    """Every line of a JSONL file's bytes ``data``, with its record when it is a good one."""
    # Split on newlines only (as the writers end their lines, and as editors count them), not splitlines()'s
    # other separators, which a line's own text may hold.
    rows = data.split(b"\n")
    if rows[-1] == b"":
        rows.pop()  # the end of the last line
    out = []
    for i, row in enumerate(rows):
        if not row.strip():
            continue
        torn = i == len(rows) - 1 and not data.endswith(b"\n")
        try:
            record = parse_json(row, nan=True)
        except BadLine:
            out.append(Line(i + 1, row, None, None if torn else "not JSON"))
            continue
        why = check(record) if isinstance(record, dict) else f"{_kind(record)}, not a record"
        out.append(Line(i + 1, row, None if why else record, why))
    return out


def read_records(path: Path, check: Check = check_record) -> list[Record]:
    """The good records of the JSONL file ``path``; every bad line is skipped with a warning naming it."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise NotFoundError(f"{path} not found", hint="name a run directory of lingctl train") from None
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    records = []
    for line in lines(data, check):
        if line.record is not None:
            records.append(line.record)
        elif line.why is not None:
            warn_bad(path, line, "skipped")
    return records


def cut_back(path: Path, step: int) -> list[Record]:
    """Drop the records written after the checkpoint of ``step`` (and a torn last line), so that a resumed
    run's records continue the file as if there had been no interruption; returns the dropped step records.
    A bad line stays as it is, with a warning: readers skip it, and it may not be lingctl's to delete."""
    kept: list[bytes] = []
    dropped = []
    for line in lines(path.read_bytes()) if path.exists() else []:
        record = line.record
        if record is None:
            if line.why is not None:
                warn_bad(path, line, "kept as it is")
                kept.append(line.raw)
        elif record.get("step", 0) <= step and record["event"] != "done":
            if record.get("step") == step and record["event"] not in ("step", "eval", "checkpoint"):
                continue
            kept.append(line.raw)
        elif record["event"] == "step":
            dropped.append(record)
    with atomic_write(path) as (_, f):
        f.write(b"".join(k + b"\n" for k in kept))
    return dropped


def warn_bad(path: Path, line: Line, what: str) -> None:
    log.warning("%s:%d: %s: %s (%s)", path, line.number, what, line.why, _cut(line.text))


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return "a number out of range" if isinstance(value, int) else f"the number {value}"
    if isinstance(value, str):
        return "text"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def _cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
