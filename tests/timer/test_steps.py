"""Step breakdown on synthetic records: every nanosecond of a step in exactly one (innermost) category."""

from __future__ import annotations

import pytest

from lingctl.timer.ring import Kind, Op, Record
from lingctl.timer.steps import breakdown, step_times

MS = 1_000_000


def rec(
    kind: Kind, start_ms: float, end_ms: float, *, op: Op = Op.NONE, group: int = 0xFFFF, seq: int = 0, value: int = 0
) -> Record:
    return Record(int(kind), int(op), group, seq, int(start_ms * MS), int(end_ms * MS), value)


def training_step(
    step: int,
    t0: float,
    *,
    data: float = 10,
    fwd: float = 20,
    bwd: float = 40,
    ar: float = 15,
    opt: float = 5,
    gap: float = 2,
) -> list[Record]:
    """data, gap, forward, gap, backward with an all_reduce inside its tail, gap, optimizer, gap."""
    t = t0
    out = [rec(Kind.DATA, t, t + data)]
    t += data + gap
    out.append(rec(Kind.FORWARD, t, t + fwd))
    t += fwd + gap
    out.append(rec(Kind.BACKWARD, t, t + bwd))
    out.append(rec(Kind.COLLECTIVE, t + bwd - ar - 1, t + bwd - 1, op=Op.ALL_REDUCE, group=0, seq=step, value=4096))
    t += bwd + gap
    out.append(rec(Kind.OPTIMIZER, t, t + opt))
    t += opt + gap
    out.append(rec(Kind.STEP, t0, t, seq=step))
    return out


def test_parts_are_innermost_and_add_up_exactly() -> None:
    records = training_step(1, 0.0)
    (s,) = step_times(records)
    assert s.step == 1 and s.duration_ns == 83 * MS
    assert s.parts_ns == {
        "data": 10 * MS,
        "forward": 20 * MS,
        "backward": 25 * MS,
        "all_reduce": 15 * MS,
        "optimizer": 5 * MS,
        "other": 8 * MS,
    }
    assert sum(s.parts_ns.values()) == s.duration_ns


def test_summary_over_the_last_n_steps() -> None:
    records = []
    t = 0.0
    for step, data in enumerate([100, 10, 20, 30], start=1):  # the first step is outside the window
        records += training_step(step, t, data=data)
        t += 73 + data
    stats = breakdown(records, last_n_steps=3)
    assert stats.steps == 3 and stats.last_step == 4
    assert [p.step for p in stats.per_step] == [2, 3, 4]
    assert stats.step_time.mean == pytest.approx(0.093)
    assert stats.step_time.median == pytest.approx(0.093)
    assert stats.step_time.last == pytest.approx(0.103)
    assert stats.parts["data"].mean == pytest.approx(0.020)
    assert stats.parts["data"].last == pytest.approx(0.030)
    assert stats.parts["backward"].median == pytest.approx(0.025)
    assert list(stats.parts) == ["data", "forward", "backward", "optimizer", "all_reduce", "other"]
    assert sum(p.mean for p in stats.parts.values()) == pytest.approx(stats.step_time.mean)
    assert stats.throughput == pytest.approx(3 / 0.279)
    assert stats.collective_seq == {0: 4}
    assert stats.share("data") == pytest.approx(0.020 / 0.093)


def test_calls_crossing_step_boundaries_are_clipped_and_gaps_between_steps_ignored() -> None:
    records = [
        rec(Kind.STEP, 0, 10, seq=1),
        rec(Kind.STEP, 15, 25, seq=2),
        rec(Kind.DATA, 8, 18),  # 2 ms in step 1, 3 in the gap, 3 in step 2
        rec(Kind.COPY, 20, 21),
        rec(Kind.P2P, 21, 22, op=Op.SEND, group=1, seq=3),
    ]
    s1, s2 = step_times(records)
    assert s1.parts_ns == {"other": 8 * MS, "data": 2 * MS}
    assert s2.parts_ns == {"data": 3 * MS, "other": 5 * MS, "copy": MS, "p2p": MS}


def test_equal_starts_go_to_the_shorter_call_and_partial_overlaps_to_the_later_start() -> None:
    records = [
        rec(Kind.STEP, 0, 100, seq=1),
        rec(Kind.BACKWARD, 10, 50),
        rec(Kind.COLLECTIVE, 10, 20, op=Op.BROADCAST, group=0, seq=1),
        rec(Kind.COLLECTIVE, 45, 60, op=Op.BARRIER, group=0, seq=2),  # from another thread: not nested
    ]
    (s,) = step_times(records)
    assert s.parts_ns == {"broadcast": 10 * MS, "backward": 25 * MS, "barrier": 15 * MS, "other": 50 * MS}


def test_gpu_time_is_outside_the_partition() -> None:
    records = [rec(Kind.STEP, 0, 10, seq=1), rec(Kind.FORWARD, 0, 4), rec(Kind.GPU, 1, 7)]
    stats = breakdown(records)
    assert stats.per_step[0].parts_ns == {"forward": 4 * MS, "other": 6 * MS}
    assert stats.gpu is not None and stats.gpu.mean == pytest.approx(0.006)


def test_no_finished_step() -> None:
    stats = breakdown([rec(Kind.FORWARD, 0, 4), rec(Kind.COLLECTIVE, 4, 5, op=Op.ALL_REDUCE, group=2, seq=7)])
    assert stats.steps == 0 and stats.last_step is None and stats.throughput == 0.0
    assert stats.step_time.mean == 0.0 and stats.parts == {}
    assert stats.collective_seq == {2: 7}


def test_many_steps_are_fast() -> None:
    import time

    records = []
    for step in range(2000):
        records += training_step(step, step * 100.0)
    t = time.perf_counter()
    stats = breakdown(records, last_n_steps=2000)
    assert time.perf_counter() - t < 2.0
    assert stats.steps == 2000 and stats.parts["all_reduce"].mean == pytest.approx(0.015)
