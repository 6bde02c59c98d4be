from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.output import Output, dumps


@dataclass
class Row:
    path: Path
    loss: float


def test_json_mode_writes_one_document_to_stdout_only() -> None:
    stdout, stderr = io.StringIO(), io.StringIO()
    out = Output(True, stdout=stdout, stderr=stderr)
    out.info("working...")
    out.result({"rows": [Row(Path("/x"), 1.5)]}, "human text")
    assert json.loads(stdout.getvalue()) == {"rows": [{"path": "/x", "loss": 1.5}]}
    assert stderr.getvalue() == ""


def test_json_lines_for_streams() -> None:
    stdout = io.StringIO()
    out = Output(True, stdout=stdout, stderr=io.StringIO())
    for i in range(3):
        out.record({"step": i}, f"step {i}")
    assert [json.loads(line)["step"] for line in stdout.getvalue().splitlines()] == [0, 1, 2]


def test_human_mode_result_on_stdout_messages_on_stderr() -> None:
    stdout, stderr = io.StringIO(), io.StringIO()
    out = Output(False, stdout=stdout, stderr=stderr)
    out.info("copying")
    out.warn("slow disk")
    out.result({"a": 1}, "3 objects, 12 bytes")
    assert stdout.getvalue() == "3 objects, 12 bytes\n"
    assert "copying" in stderr.getvalue() and "warning: slow disk" in stderr.getvalue()


def test_progress_is_off_without_a_terminal() -> None:
    stderr = io.StringIO()
    out = Output(False, stdout=io.StringIO(), stderr=stderr)
    assert not out.progress_enabled
    with out.progress("copy", total=10, unit="bytes") as task:
        task.advance(5)
        task.update(total=20)
    assert stderr.getvalue() == ""


def test_non_finite_floats_become_null() -> None:
    assert json.loads(dumps({"x": math.nan, "y": math.inf, "z": 1.0})) == {"x": None, "y": None, "z": 1.0}
