"""The reporter turns metrics records into TensorBoard scalars, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from lingctl.core.errors import LingctlError
from lingctl.train.report import event_dir, open_reporter, require, scalars

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _step(step: int, loss: float, spikes: int) -> dict:
    return {
        "event": "step",
        "step": step,
        "loss": loss,
        "lr": 1e-3 * step,
        "grad_norm": 0.5 + step,
        "tokens_per_s": 1000.0 * step,
        "spikes_skipped": spikes,
        "time": 1.0 + step,
        "expert_load": [{"max": 1.5, "min": 0.5, "cv": 0.2 * step}, {"max": 2.0, "min": 0.1, "cv": 0.3}],
    }


def test_step_and_eval_records_become_the_documented_scalars(tmp_path):
    reporter = open_reporter("tensorboard", tmp_path, name="run", config={})
    assert reporter is not None and reporter.directory == event_dir(tmp_path)
    for record in [
        {"event": "preparing", "run_dir": str(tmp_path)},
        _step(1, 3.0, 0),
        {"event": "spike", "step": 1, "reason": "loss"},
        _step(2, 2.5, 1),
        {"event": "eval", "step": 2, "eval_loss": 2.75},
        {"event": "checkpoint", "step": 2, "path": "x"},
    ]:
        reporter.record(record)
    reporter.close()
    acc = EventAccumulator(str(event_dir(tmp_path)))
    acc.Reload()
    values = {tag: [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert values["train/loss"] == [(1, 3.0), (2, 2.5)]
    assert values["train/lr"] == [(1, 0.001), (2, 0.002)]
    assert values["train/grad_norm"] == [(1, 1.5), (2, 2.5)]
    assert values["train/tokens_per_s"] == [(1, 1000.0), (2, 2000.0)]
    assert values["train/spikes_skipped"] == [(1, 0.0), (2, 1.0)]
    assert values["eval/loss"] == [(2, 2.75)]
    assert values["experts/layer_0/cv"] == [(1, 0.2), (2, 0.4)]
    assert values["experts/layer_1/max_over_mean"] == [(1, 2.0), (2, 2.0)]
    assert len(values) == 6 + 2 * 2


def test_records_without_scalars_create_no_files(tmp_path):
    reporter = open_reporter("tensorboard", tmp_path, name="run", config={})
    assert reporter is not None
    reporter.record({"event": "preparing", "run_dir": str(tmp_path)})
    reporter.close()
    assert not event_dir(tmp_path).exists()
    assert scalars({"event": "lr_drop", "step": 3, "lr_scale": 0.5}) == {}


def test_several_workers_throughput_is_one_curve_per_worker():
    step = {**_step(3, 2.0, 0), "worker_tokens_per_s": [900.0, 450.0]}
    assert scalars(step)["workers/rank_1/tokens_per_s"] == 450.0
    assert scalars(step)["train/loss"] == 2.0
    sync = {"event": "sync", "step": 8, "worker_tokens_per_s": [1200.0, 300.0], "local_steps": [8, 2]}
    assert scalars(sync) == {"workers/rank_0/tokens_per_s": 1200.0, "workers/rank_1/tokens_per_s": 300.0}


def test_none_reports_nowhere_and_a_missing_package_is_one_line():
    assert open_reporter("none", Path("."), name="run", config={}) is None
    require("none")
    require("tensorboard")
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(LingctlError, match=r"pip install 'lingctl\[wandb\]'"):
            require("wandb")
    else:
        require("wandb")
