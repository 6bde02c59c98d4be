"""The training settings, each declared once as a field (lingctl.runs.train_config): its range rule, its flag
and help text, whether a resume may change it and whether it is a first-attempt drill."""

from __future__ import annotations

import dataclasses

import pytest

from lingctl.core.errors import UsageError
from lingctl.runs.settings import check_settings, setting_of, top_level, walk
from lingctl.runs.train_config import CODE_REPO, MAX_SHARD_SIZE, EditConfig, SpikeConfig, TrainConfig


def test_the_checkpoint_file_defaults_match_the_model_package() -> None:
    from lingctl.model.hf_files import DEFAULT_MAX_SHARD_SIZE

    assert MAX_SHARD_SIZE == DEFAULT_MAX_SHARD_SIZE
    assert CODE_REPO == ""  # self-contained checkpoints unless a Hub repository is named


def test_an_error_names_the_setting_and_its_flag() -> None:
    config = TrainConfig()
    config.optim.lr = float("nan")
    with pytest.raises(UsageError, match=r"^optim.lr \(--lr\) must be a finite number > 0, got nan$"):
        config.validate()
    config = TrainConfig(watchdog_config=dataclasses.replace(TrainConfig().watchdog_config, lr_factor=1.0))
    with pytest.raises(UsageError, match=r"^watchdog_config.lr_factor must be a number in \(0, 1\), got 1.0$"):
        config.validate()


def test_the_tools_own_tables_are_checked_as_value_errors_on_their_own() -> None:
    with pytest.raises(ValueError, match="spike.ema_beta"):
        SpikeConfig(ema_beta=1.0).validate()
    with pytest.raises(ValueError, match="edit.clip_norm"):
        EditConfig(clip_norm=float("inf")).validate()
    with pytest.raises(UsageError, match="^edit.clip_norm"):
        check_settings(TrainConfig(edit=EditConfig(clip_norm=0.0)))


def test_flags_are_unique_and_every_flagged_setting_has_help() -> None:
    flagged = [(name, s) for name, _, s in walk(TrainConfig) if s.flag]
    names = [s.flag_name for _, s in flagged]
    assert len(names) == len(set(names)) and "--lr" in names and "--data" in names
    assert all(s.help for name, s in flagged if name != "seed")


def test_resumable_settings_and_first_attempt_drills() -> None:
    resumable = top_level(TrainConfig, lambda s: s.resumable)
    assert {"steps", "max_seconds", "watchdog_config", "simulate_hang"} <= resumable
    assert not {"seed", "preset", "optim", "data", "sync"} & resumable
    once = top_level(TrainConfig, lambda s: s.once)
    assert once == {"crash_at_step", "simulate_hang", "simulate_nan", "simulate_spikes", "simulate_routing_collapse"}
    assert once <= resumable
    assert setting_of(next(f for f in dataclasses.fields(TrainConfig) if f.name == "slowdown")).flag == "--slowdown"
