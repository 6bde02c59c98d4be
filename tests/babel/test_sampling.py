from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lingctl.babel.sampling import (
    DEFAULT_SAMPLE_SIZE,
    DEFAULT_SAMPLES,
    block_damage_detection,
    coverage,
    detection_probability,
    sample_ranges,
)

MiB = 1 << 20
GiB = 1 << 30


def _check_shape(size: int, ranges: list[tuple[int, int]], sample_size: int) -> None:
    """Sorted, non-overlapping, in bounds, and aligned except for the tail range."""
    end = 0
    for offset, length in ranges:
        assert length > 0
        assert offset >= end, f"{ranges} overlap or are unsorted"
        assert offset + length <= size
        assert offset % sample_size == 0 or offset == size - sample_size
        end = offset + length


def test_same_inputs_give_same_ranges() -> None:
    assert sample_ranges("ckpt/step-100/model.safetensors", 100 * GiB) == sample_ranges(
        "ckpt/step-100/model.safetensors", 100 * GiB
    )


def test_known_value_pins_the_seeding() -> None:
    # Recorded once. If this changes, a source and a destination running different lingctl versions
    # would read different bytes and every sampled verify between them would fail.
    ranges = sample_ranges("a", 100 * MiB, samples=6, sample_size=MiB)
    assert [(offset // MiB, length // MiB) for offset, length in ranges] == [
        (0, 1),
        (12, 1),
        (39, 1),
        (66, 1),
        (95, 1),
        (99, 1),
    ]


def test_different_key_or_size_gives_different_ranges() -> None:
    a = sample_ranges("shard-00001.bin", 100 * GiB)
    assert a != sample_ranges("shard-00002.bin", 100 * GiB)
    assert a != sample_ranges("shard-00001.bin", 100 * GiB + 1)


@pytest.mark.parametrize("size", [64 * MiB + 1, 100 * GiB, 100 * GiB + 12345, 10**12])
def test_large_objects_are_sampled(size: int) -> None:
    ranges = sample_ranges("model.pt", size)
    _check_shape(size, ranges, DEFAULT_SAMPLE_SIZE)
    assert ranges[0][0] == 0 and ranges[0][1] >= DEFAULT_SAMPLE_SIZE
    assert ranges[-1][0] + ranges[-1][1] == size and ranges[-1][1] >= DEFAULT_SAMPLE_SIZE
    assert sum(n for _, n in ranges) == DEFAULT_SAMPLES * DEFAULT_SAMPLE_SIZE


def test_touching_blocks_are_merged() -> None:
    # 65 blocks, 64 sampled: almost everything touches, and each read should be one request.
    ranges = sample_ranges("k", 65 * MiB, samples=64, sample_size=MiB)
    _check_shape(65 * MiB, ranges, MiB)
    assert len(ranges) <= 2
    assert sum(n for _, n in ranges) == 64 * MiB


def test_exact_fit_reads_every_block() -> None:
    # size // sample_size == samples with a ragged tail: every aligned block but the partial one is read.
    size = 8 * 1000 + 500
    ranges = sample_ranges("k", size, samples=8, sample_size=1000)
    _check_shape(size, ranges, 1000)
    assert sum(n for _, n in ranges) == 8 * 1000


@pytest.mark.parametrize("size", [1, 4096, 64 * MiB - 1, 64 * MiB])
def test_small_objects_are_read_whole(size: int) -> None:
    assert sample_ranges("small", size) == [(0, size)]
    assert coverage(size, sample_ranges("small", size)) == 1.0


def test_empty_object_has_no_ranges() -> None:
    assert sample_ranges("empty", 0) == []
    assert coverage(0, []) == 1.0


def test_coverage_is_the_sampled_fraction() -> None:
    size = 100 * GiB
    ranges = sample_ranges("x", size)
    assert coverage(size, ranges) == sum(n for _, n in ranges) / size == pytest.approx(0.000625)
    # Overlapping or out-of-bounds input counts each byte once.
    assert coverage(100, [(0, 50), (25, 50), (90, 40)]) == 0.85


def test_detection_probability_documented_values() -> None:
    assert detection_probability(64 * MiB) == 1.0
    assert detection_probability(0) == 1.0
    assert detection_probability(100 * GiB) == pytest.approx(0.000625)
    assert detection_probability(100 * GiB, changed_bytes=MiB) == pytest.approx(0.00125, rel=1e-5)
    assert detection_probability(200 * MiB, changed_bytes=10 * GiB) == 1.0


def test_block_damage_detection_documented_values() -> None:
    size = 100 * GiB
    assert block_damage_detection(size, 0.001) == pytest.approx(0.062, abs=5e-4)
    assert block_damage_detection(size, 0.01) == pytest.approx(0.474, abs=5e-4)
    assert block_damage_detection(size, 0.05) == pytest.approx(0.962, abs=5e-4)
    assert block_damage_detection(size, 0.10) == pytest.approx(0.9988, abs=5e-5)
    assert block_damage_detection(size, 0.0) == 0.0
    assert block_damage_detection(MiB, 0.001) == 1.0
    # The 95% threshold quoted in the docstring.
    f95 = 1 - 0.05 ** (1 / DEFAULT_SAMPLES)
    assert block_damage_detection(size, f95) == pytest.approx(0.95)
    assert f95 == pytest.approx(0.046, abs=5e-4)
    assert math.isclose(block_damage_detection(size, 0.2, 2, MiB), 1 - 0.8**2)


@pytest.mark.parametrize("kwargs", [{"samples": 1}, {"sample_size": 0}])
def test_bad_parameters_are_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        sample_ranges("k", 10**9, **kwargs)
    with pytest.raises(ValueError, match="size"):
        sample_ranges("k", -1)
    with pytest.raises(ValueError, match="changed_bytes"):
        detection_probability(10**9, changed_bytes=0)
    with pytest.raises(ValueError, match="damaged_fraction"):
        block_damage_detection(10**9, 1.5)


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(0, 10**12),
    key=st.text(max_size=40),
    samples=st.integers(2, 80),
    sample_size=st.sampled_from([1, 7, 4096, MiB]),
)
def test_ranges_stay_in_bounds_and_disjoint(size: int, key: str, samples: int, sample_size: int) -> None:
    ranges = sample_ranges(key, size, samples=samples, sample_size=sample_size)
    _check_shape(size, ranges, sample_size)
    total = sum(n for _, n in ranges)
    assert total == min(size, samples * sample_size)
    if size > samples * sample_size:
        assert ranges[0][0] == 0 and ranges[-1][0] + ranges[-1][1] == size
    assert coverage(size, ranges) == (total / size if size else 1.0)
