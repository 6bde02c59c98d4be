"""The training memory plan: what `train --dry-run` prints and what a real run checks before it writes anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lingctl.cli import run
from lingctl.model.presets import preset
from lingctl.train.memory_plan import plan_training


def test_the_plan_counts_adamw_state_and_scales_activations_with_the_batch() -> None:
    c = preset("small")
    one = plan_training(c, batch_size=1, seq_len=256, dtype="float32", workers=1, available=1 << 40)
    eight = plan_training(c, batch_size=8, seq_len=256, dtype="float32", workers=2, available=1 << 40)
    assert one.weights_bytes == 4 * c.num_parameters() == one.grads_bytes == one.optimizer_bytes // 2
    assert eight.activation_bytes == 8 * one.activation_bytes
    assert eight.total_bytes == 2 * eight.per_worker_bytes
    half = plan_training(c, batch_size=8, seq_len=256, dtype="bfloat16", workers=1, available=1 << 40)
    assert half.activation_bytes < eight.activation_bytes and half.weights_bytes == eight.weights_bytes
    assert not plan_training(c, batch_size=8, seq_len=256, dtype="float32", workers=1, available=1 << 20).fits


def test_dry_run_prints_the_plan_and_refuses_what_does_not_fit(capsys, tmp_path: Path) -> None:
    code = run(["train", "--preset", "tiny", "--dry-run", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] and plan["workers"] == 1 and plan["params"] == preset("tiny").num_parameters()
    code = run(["train", "--preset", "ling-lite", "-n"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "memory plan per worker" in out and "AdamW" in out and "it does not fit" in out
    assert err.startswith("lingctl: error: the run needs") and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_cannot_fit_is_refused_before_its_run_directory_exists(tmp_path: Path) -> None:
    """Ling-lite's plan (about 290 GiB: float32 weights, gradients and AdamW) exceeds any machine this runs on,
    so the run is refused in one line, before the run directory is made."""
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "lingctl", "train", "--preset", "ling-lite", "--steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("lingctl: error: the run needs") and lines[1].startswith("hint: ")
    assert not out.exists()


def test_the_plan_is_close_to_a_real_runs_peak_memory(tmp_path: Path) -> None:
    """A real run of a few steps stays within the plan (measured: small 1.17 GiB peak against 1.2 planned)."""
    preset_name = "small"
    plan = json.loads(
        subprocess.run(
            [sys.executable, "-m", "lingctl", "train", "--preset", preset_name, "--dry-run", "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
    )
    probe = (
        "import resource, subprocess, sys; "
        f"subprocess.run([sys.executable, '-m', 'lingctl', 'train', '--preset', '{preset_name}', '--steps', '2', "
        f"'--out', '{tmp_path / 'r'}'], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    peak = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert peak <= plan["per_worker_bytes"] * 1.15, (peak, plan["per_worker_bytes"])
