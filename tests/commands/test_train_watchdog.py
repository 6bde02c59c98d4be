"""The launcher's watchdog and restart loop as real processes: a drilled hang on rank 1 is detected from the
workers' trace rings, diagnosed, recorded and restarted from the last checkpoint. (Bad input is never
restarted: test_train_workers.py's bad-input test; the rule itself: tests/train/test_watchdog.py.)"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = ("train", "--preset", "tiny", "--eval-every", "0", "--nproc", "2")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_hung_rank_is_detected_diagnosed_and_the_job_resumes_from_the_last_checkpoint(lingctl, tmp_path, text_corpus):
    run = tmp_path / "run"
    res = lingctl(
        *TINY,
        "--steps",
        "8",
        "--save-every",
        "3",
        "--simulate-hang",
        "1:5",
        "--hang-timeout",
        "4",
        "--data",
        str(text_corpus),
        "--json",
        "--out",
        str(run),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "a worker hung" in res.stderr and "restart 1 of 3" in res.stderr, res.stderr
    steps = [r for r in lines(run / "metrics.jsonl") if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))  # one history: no step twice, none missing
    (hang,) = [r for r in lines(run / "incidents.jsonl") if r["kind"] == "hang"]
    assert hang["ranks"] == [1] and hang["action"] == "restart" and hang["attempt"] == 0, hang
    assert hang["restored_step"] == 3 and hang["lost_steps"] == 1  # rank 1 hung before its 5th step
    step_s = statistics.median(r["step_s"] for r in steps)
    assert 4 <= hang["detected_after_s"] <= max(30, 3 * step_s), hang
    assert hang["recovery_s"] is not None and hang["recovery_s"] > 0, hang
    # The verdict file: the collective rank 0 waits in, the rank that never arrived, and that rank's stack
    # inside the drill's receive.
    verdict = json.loads((run / hang["details"]["verdict"]).read_text())
    assert verdict["collective"]["never_arrived"] == [1] and verdict["collective"]["waiting"] == [0], verdict
    assert verdict["collective"]["op"] in verdict["summary"] and "never arrived: rank 1" in verdict["summary"]
    assert "_hang_drill" in verdict["stacks"]["1"] and "in recv" in verdict["stacks"]["1"]
    done = [json.loads(line) for line in res.stdout.splitlines() if '"event": "done"' in line]
    assert done[-1]["steps"] == 8 and done[-1]["resumed_from"] == 3
