"""Segment KV cache: allocator placement and merging, sequence growth, the randomized invariants, KVPool."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lingctl.flood.engine.segment_cache import Growth, KVPool, Segment, SegmentAllocator, SequenceKV, grow


def allocate(alloc: SegmentAllocator, n: int) -> Segment:
    """``alloc.allocate(n)`` where the test expects it to succeed."""
    seg = alloc.allocate(n)
    assert seg is not None
    return seg


def carve(capacity: int, sizes: list[int], keep: list[bool]) -> tuple[SegmentAllocator, list[Segment]]:
    """An allocator with segments of ``sizes`` laid out from 0, then those with ``keep=False`` freed: a
    chosen free list without reaching into the allocator."""
    alloc = SegmentAllocator(capacity, debug=True)
    segs = [allocate(alloc, n) for n in sizes]
    assert all(s is not None for s in segs)
    for seg, k in zip(segs, keep):
        if not k:
            alloc.free(seg)
    return alloc, [s for s, k in zip(segs, keep) if k]


# -- allocation --------------------------------------------------------------------------------------------


def test_allocate_until_full_returns_none() -> None:
    alloc = SegmentAllocator(10, debug=True)
    assert alloc.allocate(11) is None
    segs = [allocate(alloc, 3) for _ in range(3)]
    assert [(s.start, s.length) for s in segs] == [(0, 3), (3, 3), (6, 3)]
    assert alloc.allocate(3) is None
    assert alloc.allocate(1) is not None
    assert alloc.allocate(1) is None
    assert (alloc.used_slots, alloc.free_slots, alloc.largest_free(), alloc.free_blocks()) == (10, 0, 0, [])


def test_allocate_rejects_nonpositive_size() -> None:
    alloc = SegmentAllocator(10)
    with pytest.raises(ValueError, match="-2"):
        alloc.allocate(-2)
    with pytest.raises(ValueError, match="0"):
        alloc.allocate(0)


@pytest.mark.parametrize(
    ("n", "start"),
    [
        (30, 0),  # 30 >= 0.75 * 40: the first block is filled well -> first-fit
        (40, 0),  # exact fit of the first block
        (12, 0),  # only the large block holds 12
        (8, 60),  # 8 would leave most of the large block: best-fit picks the tight 10-slot block
        (10, 60),  # exact fit later beats splitting the large block
    ],
)
def test_first_fit_when_filled_well_best_fit_otherwise(n: int, start: int) -> None:
    # free: [0, 40) large and early, [60, 70) tight and later
    alloc, _ = carve(100, [40, 20, 10, 30], [False, True, False, True])
    assert alloc.free_blocks() == [(0, 40), (60, 10)]
    seg = alloc.allocate(n)
    assert seg is not None and seg.start == start


def test_best_fit_ties_go_to_lowest_start() -> None:
    alloc, _ = carve(100, [40, 5, 10, 5, 10, 30], [False, True, False, True, False, True])
    assert alloc.free_blocks() == [(0, 40), (45, 10), (60, 10)]
    assert allocate(alloc, 9).start == 45


def test_good_fit_one_means_best_fit_unless_exact() -> None:
    alloc, _ = carve(100, [40, 20, 10, 30], [False, True, False, True])
    alloc.good_fit = 1.0
    assert allocate(alloc, 35).start == 0  # only the large block fits
    alloc, _ = carve(100, [40, 20, 10, 30], [False, True, False, True])
    alloc.good_fit = 0.1
    assert allocate(alloc, 8).start == 0  # any fill counts as good: plain first-fit


# -- extend, free, shrink ----------------------------------------------------------------------------------


def test_extend_in_place_only_into_a_free_neighbour() -> None:
    alloc = SegmentAllocator(20, debug=True)
    a = allocate(alloc, 4)
    assert alloc.extend(a, 6) and (a.start, a.length) == (0, 10)
    b = allocate(alloc, 5)  # [10, 15): a's neighbour is now taken
    assert not alloc.extend(a, 1) and a.length == 10
    assert not alloc.extend(b, 6) and b.length == 5  # 5 free after b, asks for 6
    assert alloc.extend(b, 5) and b.end == 20
    assert not alloc.extend(b, 1)  # end of the pool
    assert alloc.free_blocks() == []


def test_free_merges_left_right_and_both() -> None:
    alloc = SegmentAllocator(50, debug=True)
    a, b, c, d, e = (allocate(alloc, 10) for _ in range(5))
    alloc.free(b)
    assert alloc.free_blocks() == [(10, 10)]
    alloc.free(a)  # merges with the free block on its right
    assert alloc.free_blocks() == [(0, 20)]
    alloc.free(d)
    alloc.free(e)  # merges with the free block on its left
    assert alloc.free_blocks() == [(0, 20), (30, 20)]
    alloc.free(c)  # merges both sides
    assert alloc.free_blocks() == [(0, 50)]
    assert alloc.used_slots == 0


def test_shrink_gives_back_the_tail_and_merges() -> None:
    alloc = SegmentAllocator(30, debug=True)
    a = allocate(alloc, 20)
    a.used = 5
    alloc.shrink(a, 8)
    assert (a.length, alloc.free_blocks()) == (8, [(8, 22)])
    alloc.shrink(a, 8)  # no-op
    for bad in (4, 9, 0):
        with pytest.raises(ValueError, match=str(bad)):
            alloc.shrink(a, bad)
    assert a.length == 8


def test_double_free_and_foreign_segment_raise() -> None:
    alloc = SegmentAllocator(10)
    a = allocate(alloc, 4)
    alloc.free(a)
    with pytest.raises(ValueError, match="not a live segment"):
        alloc.free(a)
    b = allocate(alloc, 4)
    for op in (alloc.free, lambda s: alloc.extend(s, 1), lambda s: alloc.shrink(s, 1)):
        with pytest.raises(ValueError, match="not a live segment"):
            op(Segment(start=b.start, length=b.length))  # equal fields, but not the one handed out
    alloc.check()


def test_check_reports_corruption() -> None:
    alloc = SegmentAllocator(10)
    alloc.allocate(4)
    alloc._free = [(4, 3), (7, 3)]  # adjacent blocks that should have merged
    with pytest.raises(AssertionError, match="starts at or before"):
        alloc.check()
    alloc._free = [(3, 7)]  # overlaps the live segment
    alloc._free_slots = 7
    with pytest.raises(AssertionError, match="overlaps"):
        alloc.check()


# -- SequenceKV and grow -----------------------------------------------------------------------------------


def test_sequence_slots_advance_and_ranges() -> None:
    prefix = Segment(start=0, length=8, used=8)
    first = Segment(start=8, length=4, used=4)  # starts where the prefix ends: one range
    second = Segment(start=20, length=6, used=1)
    seq = SequenceKV(shared=[prefix], own=[first, second])
    assert (seq.length(), seq.capacity_left()) == (13, 5)
    assert seq.ranges() == [(0, 12), (20, 21)]
    assert seq.slots_for_next(3) == [21, 22, 23]
    assert seq.slots_for_next(3) == [21, 22, 23]  # does not advance
    seq.advance(3)
    assert (seq.length(), seq.capacity_left(), seq.ranges()) == (16, 2, [(0, 12), (20, 24)])
    with pytest.raises(ValueError, match="3 tokens"):
        seq.slots_for_next(3)
    with pytest.raises(ValueError, match="3 tokens"):
        seq.advance(3)
    empty = SequenceKV(shared=[prefix], own=[])
    assert (empty.capacity_left(), empty.slots_for_next(0), empty.ranges()) == (0, [], [(0, 8)])
    with pytest.raises(ValueError):
        empty.slots_for_next(1)


def test_grow_extends_by_chunk_then_by_shortfall() -> None:
    alloc = SegmentAllocator(40, debug=True)
    seq = SequenceKV(shared=[], own=[allocate(alloc, 4)])
    seq.advance(4)
    assert grow(alloc, seq, 1, chunk=8) is Growth.EXTENDED
    assert seq.own[0].length == 12  # by the chunk, not just 1
    assert grow(alloc, seq, 8, chunk=8) is Growth.FITS
    seq.advance(8)
    gap = allocate(alloc, 2)  # [12, 14)
    blocker = allocate(alloc, 26)  # [14, 40)
    alloc.free(gap)  # leave exactly 2 free after seq's segment
    assert grow(alloc, seq, 2, chunk=8) is Growth.EXTENDED
    assert (len(seq.own), seq.own[0].length, blocker.start) == (1, 14, 14)


def test_grow_appends_and_trims_the_old_tail() -> None:
    alloc = SegmentAllocator(40, debug=True)
    seq = SequenceKV(shared=[], own=[allocate(alloc, 10)])
    seq.advance(6)
    alloc.allocate(5)  # [10, 15) blocks in-place growth
    assert grow(alloc, seq, 6, chunk=8) is Growth.APPENDED
    old, new = seq.own
    assert (old.length, new.length, seq.capacity_left()) == (6, 8, 8)  # tail [6, 10) given back
    assert seq.slots_for_next(6) == list(range(new.start, new.start + 6))
    assert (6, 4) in alloc.free_blocks()


def test_grow_appends_exactly_need_when_chunk_does_not_fit() -> None:
    alloc = SegmentAllocator(20, debug=True)
    seq = SequenceKV(shared=[], own=[allocate(alloc, 10)])
    seq.advance(10)
    alloc.allocate(3)  # [10, 13); 7 free after it
    assert grow(alloc, seq, 7, chunk=16) is Growth.APPENDED
    assert [(s.start, s.length) for s in seq.own] == [(0, 10), (13, 7)]


def test_grow_replaces_an_empty_last_segment() -> None:
    alloc = SegmentAllocator(30, debug=True)
    seq = SequenceKV(shared=[], own=[allocate(alloc, 2)])
    alloc.allocate(3)  # [2, 5)
    assert grow(alloc, seq, 10, chunk=4) is Growth.APPENDED
    assert [(s.start, s.length) for s in seq.own] == [(5, 10)]
    assert alloc.free_blocks() == [(0, 2), (15, 15)]


def test_grow_for_a_sequence_with_only_a_shared_prefix() -> None:
    alloc = SegmentAllocator(30, debug=True)
    prefix = allocate(alloc, 8)
    prefix.used = 8
    seq = SequenceKV(shared=[prefix], own=[])
    assert grow(alloc, seq, 3, chunk=4) is Growth.APPENDED
    seq.advance(3)
    assert seq.ranges() == [(0, 11)]  # allocated right after the prefix: still one range


def test_grow_waits_and_changes_nothing() -> None:
    alloc = SegmentAllocator(20, debug=True)
    seq = SequenceKV(shared=[], own=[allocate(alloc, 6)])
    seq.advance(4)
    alloc.allocate(4)  # [6, 10)
    alloc.allocate(6)  # [10, 16); 4 free at the end
    before = (alloc.free_blocks(), [(s.start, s.length, s.used) for s in seq.own])
    assert grow(alloc, seq, 5, chunk=8) is Growth.WAIT
    assert before == (alloc.free_blocks(), [(s.start, s.length, s.used) for s in seq.own])


def test_grow_rejects_nonpositive_arguments() -> None:
    alloc = SegmentAllocator(10)
    with pytest.raises(ValueError, match="need=0"):
        grow(alloc, SequenceKV(shared=[], own=[]), 0, chunk=4)


# -- randomized invariants ---------------------------------------------------------------------------------


def assert_bitmap_consistent(alloc: SegmentAllocator, live: list[Segment]) -> None:
    """Independent of the allocator's own bookkeeping: paint every live segment and free block."""
    owner = bytearray(alloc.capacity)
    for seg in live:
        assert not any(owner[seg.start : seg.end]), f"{seg} overlaps another live segment"
        owner[seg.start : seg.end] = b"\x01" * seg.length
    reserved = sum(owner)
    for start, length in alloc.free_blocks():
        assert not any(owner[start : start + length]), f"free block ({start}, {length}) overlaps a live segment"
        owner[start : start + length] = b"\x02" * length
    assert all(owner), "a slot is neither reserved nor free"
    assert reserved == alloc.used_slots
    assert reserved + alloc.free_slots == alloc.capacity


def test_randomized_operations_keep_invariants() -> None:
    rng = random.Random(1234)
    alloc = SegmentAllocator(512)
    loose: list[Segment] = []
    seqs: list[SequenceKV] = []
    counts = dict.fromkeys(Growth, 0)
    for _ in range(2000):
        op = rng.choice(["alloc", "alloc", "extend", "use", "shrink", "free", "grow", "grow", "drop"])
        if op == "alloc":
            n = rng.randint(1, 64)
            seg = alloc.allocate(n)
            if seg is None:
                assert alloc.largest_free() < n
            else:
                assert seg.length == n
                loose.append(seg)
        elif op == "extend" and loose:
            seg = rng.choice(loose)
            length = seg.length
            n = rng.randint(1, 16)
            ok = alloc.extend(seg, n)
            assert seg.length == (length + n if ok else length)
        elif op == "use" and loose:
            seg = rng.choice(loose)
            seg.used = rng.randint(0, seg.length)
        elif op == "shrink" and loose:
            seg = rng.choice(loose)
            alloc.shrink(seg, rng.randint(max(seg.used, 1), seg.length))
        elif op == "free" and loose:
            alloc.free(loose.pop(rng.randrange(len(loose))))
        elif op == "grow":
            if not seqs or rng.random() < 0.2:
                seqs.append(SequenceKV(shared=[], own=[]))
            seq = rng.choice(seqs)
            need = rng.randint(1, 40)
            before = (alloc.free_blocks(), [(s.start, s.length, s.used) for s in seq.own])
            result = grow(alloc, seq, need, chunk=rng.randint(1, 32))
            counts[result] += 1
            if result is Growth.WAIT:
                assert before == (alloc.free_blocks(), [(s.start, s.length, s.used) for s in seq.own])
            else:
                assert seq.capacity_left() >= need
                assert all(s.free == 0 for s in seq.own[:-1]), "only the last own segment may have room"
                seq.advance(rng.randint(1, need))
        elif op == "drop" and seqs:
            for seg in seqs.pop(rng.randrange(len(seqs))).own:
                alloc.free(seg)
        alloc.check()
        assert_bitmap_consistent(alloc, loose + [s for q in seqs for s in q.own])
    assert all(counts.values()), f"every grow outcome should occur: {counts}"
    for seg in loose + [s for q in seqs for s in q.own]:
        alloc.free(seg)
    assert alloc.free_blocks() == [(0, 512)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_property_freeing_everything_leaves_one_block(ops: list[tuple[bool, int]]) -> None:
    alloc = SegmentAllocator(100)
    live: list[Segment] = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            seg = alloc.allocate(n)
            if seg is None:
                assert alloc.largest_free() < n
            else:
                live.append(seg)
        else:
            alloc.free(live.pop(n % len(live)))
        alloc.check()
    for seg in live:
        alloc.free(seg)
    assert alloc.free_blocks() == [(0, 100)]


# -- KVPool ------------------------------------------------------------------------------------------------


def make_pool() -> KVPool:
    return KVPool(num_layers=2, capacity=32, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_kvpool_one_range_is_a_view_of_the_written_values() -> None:
    pool = make_pool()
    k_TKD, v_TKD = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    pool.write(1, torch.arange(10, 15), k_TKD, v_TKD)
    k_LKD, v_LKD = pool.gather(1, [(10, 15)])
    assert torch.equal(k_LKD, k_TKD) and torch.equal(v_LKD, v_TKD)
    assert k_LKD.data_ptr() == pool.k[1][10:15].data_ptr()
    assert v_LKD.data_ptr() == pool.v[1][10:15].data_ptr()


def test_kvpool_several_ranges_concatenate_in_order() -> None:
    pool = make_pool()
    seq = SequenceKV(shared=[Segment(start=20, length=3)], own=[Segment(start=4, length=4)])
    k_TKD, v_TKD = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    slots = [20, 21, 22]
    seq.shared[0].used = 3
    slots += seq.slots_for_next(2)
    seq.advance(2)
    pool.write(0, torch.tensor(slots), k_TKD, v_TKD)
    assert seq.ranges() == [(20, 23), (4, 6)]
    k_LKD, v_LKD = pool.gather(0, seq.ranges())
    assert k_LKD.shape == (5, 2, 4)
    assert torch.equal(k_LKD, k_TKD) and torch.equal(v_LKD, v_TKD)
    assert pool.gather(0, [])[0].shape == (0, 2, 4)


def test_kvpool_sizes() -> None:
    assert KVPool.bytes_per_token(2, 2, 4, torch.bfloat16) == 2 * 2 * 2 * 4 * 2
    pool = make_pool()
    assert pool.nbytes() == 32 * KVPool.bytes_per_token(2, 2, 4, torch.float32)
    assert pool.k[0].shape == (32, 2, 4) and len(pool.v) == 2
    with pytest.raises(ValueError, match="capacity=0"):
        KVPool(num_layers=1, capacity=0, num_kv_heads=1, head_dim=1, dtype=torch.float32)
