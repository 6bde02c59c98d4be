"""The training loop in-process on the tiny preset and a small real corpus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lingctl.runs.incidents import read as read_incidents
from lingctl.runs.train_config import DataConfig, SpikeConfig, TrainConfig
from lingctl.train.recovery import TrainingDiverged
from lingctl.train.rundir import RunDir
from lingctl.train.schedule import learning_rate
from lingctl.train.trainer import Trainer


def make(tmp_path: Path, corpus: Path, **kw: Any) -> tuple[Trainer, list[dict]]:
    records: list[dict] = []
    config = TrainConfig(preset="tiny", data=DataConfig(paths=[str(corpus)]), eval_every=0, save_every=0, **kw)
    trainer = Trainer(config, RunDir(str(tmp_path / "run")), on_record=records.append)
    trainer.setup()
    return trainer, records


def test_injected_spikes_are_skipped_retried_later_and_lower_the_lr(tmp_path: Path, text_corpus: Path) -> None:
    spike = SpikeConfig(warmup_steps=10, retry_after_steps=5, max_spikes=3, window_steps=50, lr_factor=0.5)
    trainer, records = make(tmp_path, text_corpus, steps=40, spike=spike, inject_spikes=[15, 16, 17])
    skipped_rows: list[list[int]] = []

    def on_record(r: dict[str, Any]) -> None:
        records.append(r)
        if r["event"] == "spike":
            skipped_rows.append(list(trainer.position.retries[-1].rows))

    trainer.on_record = on_record
    result = trainer.train()

    spikes = [r for r in records if r["event"] == "spike"]
    assert [s["attempt"] for s in spikes] == [15, 16, 17]
    assert all(s["action"] == "skipped" and s["retry_at_step"] == s["step"] + 5 for s in spikes)
    drops = [r for r in records if r["event"] == "lr_drop"]
    assert len(drops) == 1 and drops[0]["lr_scale"] == 0.5
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 41))  # skipped attempts are not steps
    retried = [r for r in steps if r.get("retried")]
    assert len(retried) == 3 and all(r["step"] > spikes[0]["step"] + 5 for r in retried)
    # Each retried batch came back exactly once: 40 applied steps consumed 40 fresh batches in all.
    assert trainer.position.retries == [] and trainer.position.cursor == 40 * 8
    assert len({tuple(rows) for rows in skipped_rows}) == 3
    # After the drop every step runs at half the scheduled learning rate.
    after = [r for r in steps if r["step"] > drops[0]["step"]]
    for r in after:
        scheduled = learning_rate(r["step"] - 1, peak=3e-3, warmup_steps=20, total_steps=40, min_ratio=0.1)
        assert r["lr"] == pytest.approx(0.5 * scheduled)
    assert result.spikes_skipped == 3 and result.lr_drops == 1


def test_a_batch_that_spikes_again_on_retry_is_dropped(tmp_path: Path, text_corpus: Path) -> None:
    spike = SpikeConfig(warmup_steps=10, retry_after_steps=2, max_retries=1, max_spikes=10)
    # Attempt 15 (at step 15) spikes and is due again at step 17; attempt 16 applies step 16 and
    # attempt 17 step 17, so the retry is attempt 18.
    trainer, records = make(tmp_path, text_corpus, steps=25, spike=spike, inject_spikes=[15, 18])
    trainer.train()
    actions = [r["action"] for r in records if r["event"] == "spike"]
    assert actions == ["skipped", "dropped"]
    assert trainer.position.retries == []


def test_routing_warmup_and_batch_warmup_show_in_the_records(tmp_path: Path, text_corpus: Path) -> None:
    trainer, records = make(tmp_path, text_corpus, steps=6, batch_warmup_steps=4, batch_start=2)
    trainer.config.moe.routing_warmup_steps = 4
    trainer.train()
    steps = [r for r in records if r["event"] == "step"]
    assert [r["routing_alpha"] for r in steps] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert [r["batch_size"] for r in steps][0] == 2 and steps[-1]["batch_size"] == 8
    assert all(len(r["expert_load"]) == 1 for r in steps)  # tiny: one MoE layer after one dense layer


def test_steps_skipped_in_a_row_end_the_run_and_nothing_is_saved(tmp_path: Path, text_corpus: Path) -> None:
    spike = SpikeConfig(warmup_steps=3, max_spikes=100)
    trainer, records = make(
        tmp_path,
        text_corpus,
        steps=30,
        spike=spike,
        max_consecutive_skips=4,
        inject_spikes=list(range(5, 30)),
        inject_spike_factor=100.0,
    )
    with pytest.raises(TrainingDiverged, match="4 steps in a row were skipped"):
        trainer.train()
    events = [r["event"] for r in records]
    # The live view's start record comes first, its incident record last; neither is a metric.
    assert events == ["start"] + ["step"] * 5 + ["spike"] * 4 + ["diverged", "incident"]
    assert not (tmp_path / "run" / "latest.json").exists()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == len(records) - 2
    # Recorded as a divergence the run gave up on (what tells the launcher of several workers not to restart).
    (incident,) = read_incidents(tmp_path / "run")
    assert (incident["kind"], incident["action"], incident["details"]["why"]) == (
        "divergence",
        "give_up",
        "the watchdog is off",
    )


def test_non_finite_parameters_end_the_run_at_once_even_with_the_guard_off(tmp_path: Path, text_corpus: Path) -> None:
    trainer, records = make(tmp_path, text_corpus, steps=10, spike=SpikeConfig(enabled=False))
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="parameters are no longer finite"):
        trainer.train()
    assert [r["event"] for r in records] == [
        "start",
        "spike",
        "diverged",
        "incident",
    ]  # the NaN update was never applied
    assert not (tmp_path / "run" / "latest.json").exists()
