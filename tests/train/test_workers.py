"""Pieces of the several-worker setup that need no process group: data striding and the launch line."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from lingctl.core.errors import UsageError
from lingctl.train.data import BatchOrder
from lingctl.train.supervise.launch import worker_args
from lingctl.train.supervise.torchrun import job_exit_code, launch_argv, relay_stderr
from lingctl.train.workers import strided_rows


def test_workers_read_disjoint_rows_that_together_are_the_global_order() -> None:
    order = BatchOrder(1000, seed=3)
    world, per_step = 3, 8
    seen: list[list[int]] = []
    for rank in range(world):
        rows: list[int] = []
        for step in range(10):
            rows += strided_rows(order.indices, step * per_step, per_step, rank, world)
        seen.append(rows)
    flat = [r for rows in seen for r in rows]
    assert len(flat) == len(set(flat)) == 240  # no row twice within the epoch
    interleaved = np.array(seen).T.reshape(-1)  # position p of the global order is rank p % world's
    assert interleaved.tolist() == order.indices(0, 240).tolist()
    # One worker reads the global order itself.
    assert strided_rows(order.indices, 5, 4, 0, 1) == order.indices(5, 4).tolist()


def test_the_launch_line_keeps_every_train_option_but_the_launchers_own() -> None:
    argv = ["-v", "train", "--nproc", "4", "--steps", "10", "--max-restarts=2", "--sync", "edit", "--json"]
    argv += ["--no-watchdog", "--hang-timeout", "5m", "--watchdog", "--hang-timeout=30"]
    assert worker_args(argv) == ["--steps", "10", "--sync", "edit", "--json"]
    cmd = launch_argv(4, worker_args(argv))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    # torchrun never restarts on its own: lingctl's launcher decides each attempt.
    assert "--nproc-per-node=4" in cmd and "--max-restarts=0" in cmd
    assert cmd[cmd.index("-m", 3) :][:3] == ["-m", "lingctl", "train"]
    with pytest.raises(UsageError, match="--nproc must be at least 1"):
        launch_argv(0, [])


# The tail of torchrun's failure report when worker 1 saw its peer go before worker 0's own exit was observed.
REPORT = """lingctl: error: worker 1: another worker stopped during a collective
lingctl: error: data path not found: /data/missing
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
lingctl FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_11:00:01
  rank      : 0 (local_rank: 0)
  exitcode  : 3 (pid: 101)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_11:00:00
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 102)
============================================================
"""


def test_the_job_exits_with_the_failed_workers_own_code_not_its_peers(capsys) -> None:
    codes: list[int] = []
    failures: list[tuple[int, int]] = []
    relay_stderr(io.StringIO(REPORT), codes, failures)
    assert codes == [1, 3]  # the root cause first, as torchrun observed it
    assert failures == [(1, 1), (0, 3)]  # with the failed workers' ranks
    assert job_exit_code(codes) == 3
    out = capsys.readouterr().err
    assert "data path not found" in out and "Traceback" not in out and "exitcode" not in out
    assert job_exit_code([1, 1]) == 1 and job_exit_code([]) == 1 and job_exit_code([-9, 2]) == 2
