"""Packing examples into rows, and the length curriculum's stages and order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lingctl.core.errors import UsageError
from lingctl.runs.train_config import Stage, parse_schedule
from lingctl.train.post.examples import Example, Pair
from lingctl.train.post.packing import StagedOrder, best_fit, pack


def example(n: int, i: int) -> Example:
    return Example(ids=list(range(1, n + 1)), loss_mask=[False] + [True] * (n - 1), where=f"f:{i}")


def test_best_fit_keeps_every_bin_within_capacity_and_places_every_item_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = best_fit(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # Best fit on these lengths wastes little: within 5% of the lower bound on the number of rows.
    assert len(bins) <= 1.05 * sum(lengths) / 128 + 1


def test_pairs_keep_both_answers_in_one_row_and_items_in_order() -> None:
    pairs = [Pair(chosen=example(5 + i, i), rejected=example(3 + i, i), where=f"f:{i}") for i in range(6)]
    rows = pack(pairs, [Stage(20, None)])
    for r in range(len(rows)):
        items = rows.seg_item[rows.seg_starts[r] : rows.seg_starts[r + 1]]
        sides = rows.seg_side[rows.seg_starts[r] : rows.seg_starts[r + 1]]
        assert list(sides) == [0, 1] * (len(items) // 2)
        assert list(items[::2]) == list(items[1::2])
    assert sorted(rows.seg_item[::2].tolist()) == list(range(6))
    assert rows.n_tokens == sum(len(p) for p in pairs)


def test_examples_longer_than_the_rows_are_left_out() -> None:
    rows = pack([example(4, 0), example(30, 1), example(6, 2)], [Stage(10, None)])
    assert sorted(rows.seg_item.tolist()) == [0, 2]
    with pytest.raises(UsageError, match="longer than 10 tokens"):
        pack([example(30, 0)], [Stage(10, None)])


def test_the_curriculum_trains_short_rows_first_then_mixes_in_long_examples() -> None:
    rng = random.Random(1)
    short = [example(rng.randint(5, 60), i) for i in range(200)]
    long_ = [example(rng.randint(70, 250), 200 + i) for i in range(10)]
    stages = parse_schedule("64,256@0.25", 64)
    rows = pack(short + long_, stages, seed=3)
    first, second = rows.stage_rows
    lengths = np.diff(rows.row_starts)
    assert (lengths[:first] <= 64).all() and (lengths[first:] <= 256).all()
    second_items = rows.seg_item[rows.seg_starts[first] :].tolist()
    n_long = sum(1 for i in second_items if i >= 200)
    assert n_long == 10  # every long example, once
    assert n_long / len(second_items) == pytest.approx(0.25, abs=0.02)  # 75:25 short to long, in examples
    order = StagedOrder(rows.stage_rows, seed=0)
    for epoch in range(2):
        idx = order.indices(epoch * (first + second), first + second)
        assert sorted(idx[:first]) == list(range(first)) and sorted(idx[first:]) == list(range(first, first + second))


@pytest.mark.parametrize("text", ["64@0.1", "256,64@0.1", "64,256", "64,256@1.5", "x"])
def test_a_bad_schedule_is_refused(text: str) -> None:
    with pytest.raises(UsageError, match="--seq-len-schedule"):
        parse_schedule(text, 64)
