from __future__ import annotations

from typing import TypedDict

import pytest

from lingctl.train.schedule import batch_size, learning_rate, routing_alpha


class Schedule(TypedDict):
    peak: float
    warmup_steps: int
    total_steps: int
    min_ratio: float


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    kw = Schedule(peak=1.0, warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert learning_rate(0, **kw) == pytest.approx(0.1)
    assert learning_rate(9, **kw) == pytest.approx(1.0)
    assert learning_rate(10, **kw) == pytest.approx(1.0)
    assert learning_rate(60, **kw) == pytest.approx(0.55)  # halfway through the cosine
    assert learning_rate(110, **kw) == pytest.approx(0.1)
    assert learning_rate(500, **kw) == pytest.approx(0.1)
    values = [learning_rate(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_batch_size_warmup_rises_from_start_to_target() -> None:
    sizes = [batch_size(s, target=16, start=2, warmup_steps=8) for s in range(10)]
    assert sizes[0] == 2 and sizes[8] == 16 and sizes[9] == 16
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert batch_size(0, target=16, start=2, warmup_steps=0) == 16


def test_routing_alpha_rises_linearly_from_zero_to_one() -> None:
    assert [routing_alpha(s, 4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert routing_alpha(0, 0) == 1.0
