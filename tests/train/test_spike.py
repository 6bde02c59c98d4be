from __future__ import annotations

import math

from lingctl.runs.train_config import SpikeConfig
from lingctl.train.spike import SpikeGuard


def warmed(config: SpikeConfig, n: int = 30) -> SpikeGuard:
    guard = SpikeGuard(config=config)
    for i in range(n):
        guard.accept(5.0 + 0.05 * math.sin(i), 1.0 + 0.1 * math.cos(i))
    return guard


def test_guard_is_silent_during_warmup_and_on_ordinary_noise() -> None:
    guard = SpikeGuard(config=SpikeConfig(warmup_steps=20))
    for _ in range(5):
        guard.accept(5.0, 1.0)
    assert not guard.check_loss(50.0).spike  # not armed yet
    guard = warmed(SpikeConfig())
    assert not guard.check_loss(5.1).spike
    assert not guard.check_grad(1.2).spike


def test_guard_flags_loss_and_grad_spikes_and_non_finite_values() -> None:
    guard = warmed(SpikeConfig())
    assert guard.check_loss(50.0).spike
    assert guard.check_grad(40.0).spike
    assert guard.check_loss(float("nan")).spike
    assert guard.check_grad(float("inf")).spike


def test_ratio_test_keeps_a_very_stable_run_from_flagging_small_bumps() -> None:
    guard = SpikeGuard(config=SpikeConfig(warmup_steps=5))
    for _ in range(10):
        guard.accept(5.0, 1.0)  # zero variance: any bump has a huge z-score
    assert not guard.check_loss(5.5).spike  # but 1.1x is below the 1.3x ratio
    assert guard.check_loss(7.0).spike


def test_repeated_spikes_in_a_window_lower_the_lr_and_state_round_trips() -> None:
    guard = warmed(SpikeConfig(max_spikes=3, window_steps=10, lr_factor=0.5))
    assert not guard.record_spike(100)
    assert not guard.record_spike(101)
    assert guard.record_spike(102)
    assert guard.lr_scale == 0.5 and guard.lr_drops == 1
    # Spikes far apart never accumulate in the window.
    assert not guard.record_spike(200) and not guard.record_spike(300) and not guard.record_spike(400)
    clone = SpikeGuard(config=SpikeConfig())
    clone.load_state_dict(guard.state_dict())
    assert clone.state_dict() == guard.state_dict()


def test_non_finite_values_are_never_applied_even_with_the_guard_off() -> None:
    guard = warmed(SpikeConfig(enabled=False))
    assert not guard.check_loss(50.0).spike  # off: ordinary spikes pass
    assert guard.check_loss(float("nan")).spike and guard.check_grad(float("inf")).spike
