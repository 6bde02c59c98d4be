"""A run's complete checkpoints and their token counts: from a real tiny run, and from hand-made run
directories for the cases a real run passes through only briefly (a save in progress, a torn copy)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lingctl.core.errors import NotFoundError, UsageError
from lingctl.model.checkpoint_files import CONFIG, TRAIN_CONFIG, WEIGHTS, WEIGHTS_INDEX
from lingctl.runs.checkpoints import (
    RunCheckpoint,
    is_run_dir,
    list_checkpoints,
    run_finished,
    run_target_steps,
)
from lingctl.runs.layout import CHECKPOINTS, LATEST, METRICS, checkpoint_name
from lingctl.runs.records import read_records


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, text_corpus: Path) -> Path:
    """A finished 4-step tiny run with checkpoints at steps 2 and 4 (trained in-process: a few seconds)."""
    from lingctl.runs.train_config import DataConfig, TrainConfig
    from lingctl.train.rundir import RunDir
    from lingctl.train.trainer import Trainer

    run = tmp_path_factory.mktemp("ckpts") / "run"
    config = TrainConfig(preset="tiny", data=DataConfig(paths=[str(text_corpus)]), eval_every=0, steps=4, save_every=2)
    trainer = Trainer(config, RunDir(str(run)))
    trainer.setup()
    trainer.train()
    return run


def test_a_real_run_lists_its_checkpoints_with_the_tokens_of_their_checkpoint_records(trained_run: Path) -> None:
    records = read_records(trained_run / METRICS)
    saved = {r["step"]: r["tokens"] for r in records if r["event"] == "checkpoint"}
    stepped = {r["step"]: r["tokens"] for r in records if r["event"] == "step"}
    assert sorted(saved) == [2, 4]
    # The checkpoint record carries the tokens consumed by the step it was saved after.
    assert saved == {2: stepped[2], 4: stepped[4]} and 0 < saved[2] < saved[4]

    found = list_checkpoints(trained_run)
    assert found == [
        RunCheckpoint(step=2, path=trained_run / checkpoint_name(2), tokens=saved[2]),
        RunCheckpoint(step=4, path=trained_run / checkpoint_name(4), tokens=saved[4]),
    ]
    assert all((c.path / CONFIG).is_file() for c in found)
    assert is_run_dir(trained_run) and is_run_dir(str(trained_run)) and is_run_dir(f"file://{trained_run}")
    assert not is_run_dir(found[0].path)  # a checkpoint is a model directory, not a run
    assert run_target_steps(trained_run) == 4 and run_finished(trained_run)


def _checkpoint(run: Path, step: int, *, config: bool = True, weights: bool = True, steps: int = 10) -> Path:
    """A checkpoint directory as far as listing goes: weights, training config, config.json (last)."""
    d = run / checkpoint_name(step)
    d.mkdir(parents=True)
    if weights:
        (d / WEIGHTS).write_bytes(b"\0" * 8)
    (d / TRAIN_CONFIG).write_text(json.dumps({"steps": steps}))
    if config:
        (d / CONFIG).write_text("{}")
    return d


def _latest(run: Path, step: int) -> None:
    (run / LATEST).write_text(json.dumps({"step": step, "path": checkpoint_name(step)}))


def _metrics(run: Path, records: list[dict]) -> None:
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_only_finished_checkpoints_up_to_latest_are_listed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    for step in (2, 4):
        _checkpoint(run, step)
    _checkpoint(run, 6, config=False)  # torn copy: config.json is written last
    _checkpoint(run, 8, weights=False)  # config but no weights
    sharded = _checkpoint(run, 10, weights=False)
    (sharded / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    half_sharded = _checkpoint(run, 12, weights=False)
    (half_sharded / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    _checkpoint(run, 14)  # complete, but latest.json does not name it yet: a save in progress
    (run / CHECKPOINTS / "step-16").mkdir()  # not a checkpoint name
    (run / CHECKPOINTS / "notes.txt").write_text("mine")
    _latest(run, 12)
    with caplog.at_level(logging.DEBUG, logger="lingctl.runs.checkpoints"):
        found = list_checkpoints(run)
    assert [c.step for c in found] == [2, 4, 10]
    assert all(c.tokens is None for c in found)  # no metrics.jsonl
    assert "no weights" in caplog.text and "step-00000008" in caplog.text
    assert "newer than latest.json" in caplog.text and "step-00000014" in caplog.text


def _step(step: int, tokens: int) -> dict:
    return {"event": "step", "step": step, "tokens": tokens, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 100.0}


def test_tokens_come_from_the_checkpoint_record_else_the_last_step_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (2, 4, 6):
        _checkpoint(run, step)
    _latest(run, 6)
    _metrics(
        run,
        [
            _step(2, 400),
            {"event": "checkpoint", "step": 2, "tokens": 500, "path": "x"},  # the checkpoint's own count wins
            _step(4, 800),
            _step(4, 820),  # step 4 again after a resume: the last record counts
            {"event": "checkpoint", "step": 4, "path": "x"},  # written before checkpoint records had tokens
            _step(5, 1000),
        ],
    )
    assert [(c.step, c.tokens) for c in list_checkpoints(run)] == [(2, 500), (4, 820), (6, None)]


def test_target_steps_and_finished_follow_the_latest_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "lingctl-run.json").parent.mkdir(parents=True)
    (run / "lingctl-run.json").write_text(json.dumps({"format": "lingctl-run", "version": 1, "entries": []}))
    # A run that has not completed a checkpoint: nothing to list, not finished.
    assert is_run_dir(run) and list_checkpoints(run) == []
    assert run_target_steps(run) is None and not run_finished(run)
    _checkpoint(run, 5, steps=10)
    _latest(run, 5)
    assert run_target_steps(run) == 10 and not run_finished(run)
    _checkpoint(run, 10, steps=10)
    _latest(run, 10)
    assert run_finished(run)


def test_a_directory_that_is_not_a_run_is_refused(tmp_path: Path) -> None:
    bare = _checkpoint(tmp_path, 2).parent.parent  # checkpoints/ without latest.json
    assert not is_run_dir(bare) and not is_run_dir(tmp_path / "absent")
    with pytest.raises(NotFoundError, match="not a lingctl training run"):
        list_checkpoints(bare)
    assert not is_run_dir("hf://org/model")


@pytest.mark.parametrize("run", ["s3://bucket/runs/a", Path("s3://bucket/runs/a"), "S3A://bucket/a"])
def test_a_run_in_an_object_store_asks_for_a_local_copy(run: str | Path) -> None:
    for call in (list_checkpoints, is_run_dir, run_target_steps):
        with pytest.raises(UsageError) as info:
            call(run)
        hint = info.value.hint or ""
        assert "local" in info.value.message and "evaluate a local copy: lingctl babel sync s3" in hint.lower()
        assert "://bucket/" in hint  # a Path("s3://...") (one slash) is shown as the URL it was
