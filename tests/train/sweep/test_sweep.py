"""`lingctl train sweep` as real subprocesses: points are ordinary runs, a killed sweep continues without
running finished points again; `--auto-hparams` picks from a fit and refuses a far extrapolation."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
from lingctl.train.sweep.laws import PointResult, fit_sweep
from lingctl.train.sweep.runner import RESULTS, read_results
from lingctl.train.sweep.spec import SweepSpec, points

SPEC = """
[sweep]
preset = "tiny"
families = ["moe"]
budgets = [2e9]
lrs = [1e-3, 1e-2]
batch_sizes = [4]
seq_len = 32
vocab_size = 300
eval_rows = 16
max_bytes = 200000
data = ["{data}"]
"""


def wait_for(condition, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_points_follow_the_budget() -> None:
    spec = SweepSpec(budgets=[1e10, 4e10], lrs=[1e-3], batch_sizes=[4, 8], families=["moe", "dense"], seq_len=32)
    pts = points(spec)
    assert len(pts) == 8
    for p in pts:
        assert abs(p.compute - p.budget) / p.budget < 0.05
    moe = {p.active_parameters for p in pts if p.family == "moe"}
    dense = {p.active_parameters for p in pts if p.family == "dense"}
    assert len(moe) == len(dense) == 1 and abs(moe.pop() - dense.pop()) / 1e5 < 0.05  # equal active size


def test_every_budget_trains_every_size_with_its_own_steps() -> None:
    spec = SweepSpec(budgets=[1e10], lrs=[1e-3], batch_sizes=[4], seq_len=32, sizes=[{"hidden_size": 48}, {}])
    small, large = points(spec)
    assert small.id.startswith("moe-s0-") and large.id.startswith("moe-s1-")
    assert small.active_parameters < large.active_parameters and small.steps > large.steps
    assert small.compute == pytest.approx(large.compute, rel=0.05)


def test_a_killed_sweep_continues_without_running_finished_points(tmp_path: Path, text_corpus: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(data=text_corpus))
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "lingctl", "train", "sweep", str(spec), "--out", str(out), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: len(read_results(out)) >= 1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the point it is running
        proc.wait()
    first = read_results(out)
    done_id = first[0]["id"]
    metrics = out / "runs" / done_id / "metrics.jsonl"
    stamp = metrics.stat().st_mtime_ns

    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["finished_before"] == len(first) and summary["ran"] == 2 - len(first)
    records = read_results(out)
    assert sorted(r["id"] for r in records) == sorted(p.id for p in points(_spec(spec)))
    assert metrics.stat().st_mtime_ns == stamp  # the finished point was not run again
    assert all(math.isfinite(r["eval_loss"]) for r in records)
    assert (out / RESULTS).read_text().count(f'"id": "{done_id}"') == 1

    code = cli_run(["train", "fit", str(out), "--json"])
    assert code == 0 and (out / "fit.json").exists()


def _spec(path: Path) -> SweepSpec:
    from lingctl.train.sweep.runner import load_spec_file

    return load_spec_file(path)


@pytest.fixture
def fit_file(tmp_path: Path) -> Path:
    """A fit of synthetic results over 1e9-1e11 FLOPs (lr_opt falls and the batch grows with the budget)."""
    results = []
    for c in (1e9, 1e10, 1e11):
        for lr in (1e-3, 3e-3, 1e-2):
            for b in (4, 8, 16):
                lr_opt, b_opt = 0.3 * c**-0.125, 0.29 * c**0.327
                loss = 3.0 * c**-0.05 * (1 + 0.02 * math.log(lr / lr_opt) ** 2 + 0.01 * math.log(b / b_opt) ** 2)
                results.append(
                    PointResult(family="moe", compute=c, lr=lr, batch_size=b, tokens=1, active_parameters=1, loss=loss)
                )
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(fit_sweep(results, tolerance=0.01)))
    return path


def test_auto_hparams_picks_from_the_fit_and_refuses_a_far_extrapolation(capsys, tmp_path, fit_file) -> None:
    base = ["train", "--preset", "tiny", "--auto-hparams", str(fit_file), "--dry-run", "--out", str(tmp_path / "r")]
    assert cli_run([*base, "--budget", "3e10"]) == 0
    err = capsys.readouterr().err
    assert "auto-hparams from" in err and "extrapolation 1x" in err and "lr " in err
    assert cli_run([*base, "--budget", "1e14"]) == 2
    err = capsys.readouterr().err
    assert "beyond the budgets the laws were fitted on" in err and "--force-extrapolation" in err
    assert cli_run([*base, "--budget", "1e14", "--force-extrapolation"]) == 0
    assert cli_run([*base, "--budget", "3e10", "--lr", "0.1"]) == 2
