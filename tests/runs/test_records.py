"""Reading metrics.jsonl and incidents.jsonl back: bad lines (wrong types, not records, not JSON) are skipped
with a warning naming FILE:LINE, a torn last line silently; cutting the file back for a resume keeps the bad
lines as they are."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lingctl.core.errors import NotFoundError
from lingctl.runs.incidents import Incident, append
from lingctl.runs.incidents import read as read_incidents
from lingctl.runs.records import cut_back, lines, read_records


def step(n: int, **changes: object) -> dict:
    record = {"event": "step", "step": n, "loss": 5.0, "lr": 1e-3, "tokens": 512 * n, "tokens_per_s": 900.0}
    return {**record, **changes}


GOOD = [step(1), step(2, loss=float("nan")), {"event": "checkpoint", "step": 2, "tokens": 1024}, step(3)]
# Each with why a reader would fail on it: a step it cannot compare or convert, a list, a loss as text, a
# number that is not finite where a count is due, one beyond int64, true where a number is due, a non-object.
BAD = [
    step(4, step="x"),
    [1, 2, 3],
    step(4, loss="NaN"),
    {"event": "eval", "step": 1e400, "eval_loss": 1.0},
    step(4, tokens=10**30),
    step(4, lr=True),
    step(4, expert_load=[{"cv": "high"}]),
    {"event": 7, "step": 4},
    {"event": "step", "step": 4},
]


def write(path: Path, rows: list, tail: str = "") -> None:
    body = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_text(body + tail)


def test_bad_lines_are_skipped_with_their_line_number_and_a_torn_last_line_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, [*GOOD[:2], *BAD, "not json at all", *GOOD[2:]], tail='{"event": "step", "st')
    with caplog.at_level(logging.WARNING, logger="lingctl"):
        records = read_records(path)
    assert [(r["event"], r["step"]) for r in records] == [("step", 1), ("step", 2), ("checkpoint", 2), ("step", 3)]
    warned = sorted(int(m.split(":")[1]) for m in caplog.messages)
    assert warned == list(range(3, 3 + len(BAD) + 1)), caplog.messages  # each bad line, and not the torn one
    assert all(m.startswith(f"{path}:") and ": skipped: " in m for m in caplog.messages)
    assert "step is text, not a whole number" in caplog.messages[0]
    with pytest.raises(NotFoundError):
        read_records(tmp_path / "nothing.jsonl")


def test_a_torn_line_inside_the_file_is_damage_not_a_write_in_progress() -> None:
    data = b'{"event": "step", "st\n' + json.dumps(step(1)).encode() + b"\n"
    (torn, good) = lines(data)
    assert torn.record is None and torn.why == "not JSON" and good.record is not None


def test_cutting_back_for_a_resume_keeps_bad_lines_and_drops_later_records_and_the_torn_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    write(path, [*GOOD, BAD[0], step(4), {"event": "done", "step": 4}], tail='{"event": "st')
    foreign = b'{"note": "\xff\xfe not UTF-8"}'
    path.write_bytes(path.read_bytes().replace(b"\n", b"\n" + foreign + b"\n", 1))
    with caplog.at_level(logging.WARNING, logger="lingctl"):
        dropped = cut_back(path, 2)
    assert [r["step"] for r in dropped] == [3, 4]
    good = [json.dumps(r).encode() for r in GOOD[:3]]
    assert path.read_bytes().split(b"\n") == [good[0], foreign, *good[1:], json.dumps(BAD[0]).encode(), b""]
    assert [m for m in caplog.messages if ":6: kept as it is: step is text" in m], caplog.messages
    assert [m for m in caplog.messages if ":2: kept as it is: not JSON" in m], caplog.messages


def test_incidents_of_other_types_are_skipped_so_a_resume_never_reapplies_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = Incident(
        kind="divergence",
        action="rollback",
        ranks=[0],
        detected_after_s=0.1,
        restored_step=4,
        details={"lr_factor": 0.5, "skipped_window": [8, 12]},
    )
    append(tmp_path, good)
    bad = [
        {**good.to_record(), "details": {"lr_factor": "half", "skipped_window": [8, 12]}},
        {**good.to_record(), "details": {"lr_factor": 0.5, "skipped_window": [8, "x"]}},
        {**good.to_record(), "restored_step": "4"},
        {**good.to_record(), "attempt": None},
        {**good.to_record(), "ranks": "all"},
        {**good.to_record(), "details": []},
    ]
    with open(tmp_path / "incidents.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in bad))
    with caplog.at_level(logging.WARNING, logger="lingctl"):
        found = read_incidents(tmp_path)
    assert len(found) == 1 and found[0]["details"]["skipped_window"] == [8, 12]
    assert len(caplog.messages) == len(bad)
