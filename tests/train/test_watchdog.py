"""The launcher's restart rules and the watchdog's figures, without processes: which exits a restart can fix,
the budget, the backoff, when a divergence ends a run and how the launcher reads that it did, the hang timeout
derived from a run's metrics, and reading metrics.jsonl as it grows and is rewritten."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lingctl.core.errors import UsageError
from lingctl.runs.incidents import Incident, append
from lingctl.runs.metrics_tail import MetricsTail
from lingctl.train.supervise.agent import JobOptions, backoff_s, restartable
from lingctl.train.supervise.divergence import attempt_ending, give_up_reason
from lingctl.train.supervise.hang_detector import MIN_HANG_TIMEOUT_S, hang_timeout


def test_crashes_and_hangs_restart_but_bad_input_and_stops_never_do() -> None:
    assert restartable(1)  # a worker's failure, or a peer's: exit 1
    assert restartable(-9) and restartable(137)  # killed by a signal (SIGKILL, OOM killer)
    for code in (2, 3, 4, 130):  # bad settings, not found, verification failed, stopped
        assert not restartable(code), code
    assert not restartable(0)
    assert restartable(1, hung=True) and restartable(3, hung=True)  # the watchdog killed it: a hang
    assert not restartable(1, stopped=True) and not restartable(1, hung=True, stopped=True)


def test_the_budget_defaults_to_three_with_the_watchdog_and_zero_without() -> None:
    assert JobOptions(nproc=2).watching and JobOptions(nproc=2).restarts == 3
    assert JobOptions(nproc=2, watchdog=False).restarts == 0
    assert JobOptions(nproc=2, max_restarts=1).restarts == 1
    assert JobOptions(nproc=2, watchdog=True, max_restarts=0).restarts == 0
    assert not JobOptions(nproc=1).watching
    with pytest.raises(UsageError, match="--max-restarts must be >= 0"):
        JobOptions(nproc=2, max_restarts=-1)
    with pytest.raises(UsageError, match="--hang-timeout needs the watchdog"):
        JobOptions(nproc=2, watchdog=False, hang_timeout_s=10)
    with pytest.raises(UsageError, match="--hang-timeout must be more than 0"):
        JobOptions(nproc=2, hang_timeout_s=0)


def test_backoff_doubles_from_one_second_up_to_thirty() -> None:
    assert [backoff_s(k) for k in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_the_hang_timeout_follows_step_and_save_times_unless_given() -> None:
    assert hang_timeout(None, [], None) == MIN_HANG_TIMEOUT_S
    assert hang_timeout(None, [0.5] * 10, None) == MIN_HANG_TIMEOUT_S  # fast steps: the floor
    assert hang_timeout(None, [1.0, 9.0, 9.0, 9.0, 50.0], None) == pytest.approx(90.0)  # 10 x the median
    assert hang_timeout(None, [9.0] * 3, 70.0) == pytest.approx(140.0)  # 2 x the longest save
    assert hang_timeout(4.0, [9.0] * 3, 70.0) == 4.0  # given: taken as it is


def _write(path: Path, records: list[dict], mode: str = "a") -> None:
    with open(path, mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_metrics_tail_reads_new_lines_and_starts_over_when_the_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    tail.poll()  # no file yet
    assert tail.last_step() is None
    _write(path, [{"event": "step", "step": s, "step_s": 0.2, "time": 100.0 + s} for s in (1, 2, 3, 4, 5)])
    _write(path, [{"event": "checkpoint", "step": 3, "save_s": 1.5, "time": 103.5}])
    with open(path, "a") as f:
        f.write('{"event": "step", "step": 6, "st')  # a line still being written
    tail.poll()
    assert tail.last_step() == 5 and tail.step_times() == [0.2] * 5 and tail.longest_save_s == 1.5
    with open(path, "a") as f:
        f.write('ep_s": 0.3, "time": 106.0}\n')
    tail.poll()
    assert tail.last_step() == 6 and tail.first_step_since(104.5) == (5, 105.0)
    # A restarted run drops the records after its checkpoint: a new file under the same name.
    tmp = tmp_path / "metrics.new"
    _write(tmp, [{"event": "step", "step": s, "step_s": 0.2, "time": 100.0 + s} for s in (1, 2, 3)], "w")
    os.replace(tmp, path)
    tail.poll()
    assert tail.last_step() == 3 and tail.first_step_since(110.0) is None
    _write(path, [{"event": "step", "step": 4, "step_s": 0.2, "time": 120.0}])
    tail.poll()
    assert tail.first_step_since(110.0) == (4, 120.0)


def test_divergence_ends_the_run_only_when_no_rollback_is_left() -> None:
    latest = {"step": 4, "path": "checkpoints/step-00000004"}
    assert give_up_reason(watchdog=True, latest=latest, rollbacks=2, budget=3) is None
    assert give_up_reason(watchdog=True, latest=latest, rollbacks=3, budget=3) == "3 rollback(s) done"
    assert give_up_reason(watchdog=True, latest=None, rollbacks=0, budget=3) == "there is no checkpoint to go back to"
    assert give_up_reason(watchdog=False, latest=latest, rollbacks=0, budget=3) == "the watchdog is off"


def test_the_launcher_reads_how_the_workers_ended_an_attempt_over_a_divergence(tmp_path: Path) -> None:
    def divergence(action: str, attempt: int, rank: int = 0) -> Incident:
        details = {"lr_factor": 0.5, "skipped_window": [None, 8]} if action != "give_up" else {}
        return Incident(
            kind="divergence", action=action, ranks=[rank], detected_after_s=0.1, attempt=attempt, details=details
        )

    assert attempt_ending(tmp_path, 0, 0.0) is None  # no incidents yet
    append(tmp_path, divergence("rollback", 0))  # rolled back inside the attempt, which went on
    append(tmp_path, Incident(kind="crash", action="restart", ranks=[1], detected_after_s=1.0, attempt=0))
    assert attempt_ending(tmp_path, 0, 0.0) is None
    append(tmp_path, divergence("restart", 1, rank=1))
    assert attempt_ending(tmp_path, 1, 0.0)["action"] == "restart"  # type: ignore[index]
    assert attempt_ending(tmp_path, 1, time.time() + 60) is None  # a record of an earlier job's attempt 1
    append(tmp_path, divergence("give_up", 1, rank=0))
    assert attempt_ending(tmp_path, 1, 0.0)["action"] == "give_up"  # type: ignore[index]
    assert attempt_ending(None, 1, 0.0) is None
