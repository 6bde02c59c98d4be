"""The segment KV cache: one preallocated KV pool per layer, handed out as contiguous segments of slots.

Flood (Ling report, offline inference) keeps the KV cache as one big tensor per layer and gives every
request one or more *contiguous* segments of slots in it, rather than fixed-size pages: attention then reads
a few long contiguous ranges (usually one) instead of a page table, and a request grows its segment in
place while the slots after it are free. A prefix shared by many requests is stored once, in its own
segment(s), and each request's ``SequenceKV`` lists those before its own.

Three parts:
  ``SegmentAllocator``  slot ranges in ``[0, capacity)``; pure Python. Every layer's pool uses the same
                        slot numbers, so one allocator serves them all.
  ``SequenceKV``, ``grow``  a request's chain of segments, and the policy that makes room for more tokens.
  ``KVPool``            the tensors: ``k[layer]``, ``v[layer]`` of shape ``[capacity, K, Dh]``.

Shape legend: T tokens written in one step, L tokens gathered, K KV heads, Dh head dim.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Segment:
    """``length`` slots reserved from ``start``; the first ``used`` of them hold tokens (the caller advances
    ``used``; the allocator only reads it, to refuse shrinking below it)."""

    start: int
    length: int
    used: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def free(self) -> int:
        return self.length - self.used


class SegmentAllocator:
    """Free list of ``(start, length)`` blocks kept sorted by start and merged with their neighbours.

    Lookups by start (free, extend, shrink) bisect; insertions and placement scans are O(blocks), which is
    fine for the thousands of blocks a pool holds. Live segments are tracked by start and compared by
    identity, so a double free, or freeing a copy, is an error instead of silent corruption.
    ``debug=True`` runs ``check()`` after every change.
    """

    def __init__(self, capacity: int, *, good_fit: float = 0.75, debug: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0.0 < good_fit <= 1.0:
            raise ValueError(f"good_fit must be in (0, 1], got {good_fit}")
        self.capacity = capacity
        self.good_fit = good_fit
        self.debug = debug
        self._free: list[tuple[int, int]] = [(0, capacity)]
        self._free_slots = capacity
        self._live: dict[int, Segment] = {}

    # -- placement --------------------------------------------------------------------------------------

    def allocate(self, n: int) -> Segment | None:
        """A new segment of ``n`` slots, or None when no free block holds ``n``.

        First-fit when the first block large enough would be filled well (``n >= good_fit * block``): it
        is the cheap choice and packs the pool from the low end. Otherwise best-fit (smallest block that
        fits, lowest start on ties), so a short request does not split a long block that a long sequence
        will need later: with contiguous segments, fragmentation is what turns free memory into waiting.
        """
        if n < 1:
            raise ValueError(f"segment size must be >= 1, got {n}")
        first = next((i for i, (_, length) in enumerate(self._free) if length >= n), None)
        if first is None:
            return None
        chosen = first
        if n < self.good_fit * self._free[first][1]:
            # min() keeps the first of equal lengths, and the list is sorted by start: ties -> lowest start.
            chosen = min(
                range(first, len(self._free)),
                key=lambda i: self._free[i][1] if self._free[i][1] >= n else self.capacity + 1,
            )
        start, length = self._free[chosen]
        if length == n:
            del self._free[chosen]
        else:
            self._free[chosen] = (start + n, length - n)
        self._free_slots -= n
        seg = Segment(start=start, length=n)
        self._live[start] = seg
        self._after_change()
        return seg

    def extend(self, seg: Segment, n: int) -> bool:
        """Grow ``seg`` in place by ``n`` slots if the free block right after it has room; the cheapest way
        to grow, since the request's tokens stay one contiguous range."""
        self._check_live(seg, "extend")
        if n < 1:
            raise ValueError(f"extension must be >= 1 slot, got {n}")
        i = bisect_left(self._free, (seg.end,))
        if i == len(self._free) or self._free[i][0] != seg.end or self._free[i][1] < n:
            return False
        start, length = self._free[i]
        if length == n:
            del self._free[i]
        else:
            self._free[i] = (start + n, length - n)
        seg.length += n
        self._free_slots -= n
        self._after_change()
        return True

    def free(self, seg: Segment) -> None:
        """Return all of ``seg``'s slots; the block merges with free neighbours."""
        self._check_live(seg, "free")
        del self._live[seg.start]
        self._release(seg.start, seg.length)
        self._after_change()

    def shrink(self, seg: Segment, new_length: int) -> None:
        """Give back the unused tail, keeping ``new_length`` slots (``used <= new_length <= length``).

        ``new_length`` must be >= 1: an empty segment would still own its start, so free it instead.
        """
        self._check_live(seg, "shrink")
        if not max(seg.used, 1) <= new_length <= seg.length:
            raise ValueError(
                f"cannot shrink segment at {seg.start} (used {seg.used}, length {seg.length}) "
                f"to {new_length}: need max(used, 1) <= new_length <= length"
            )
        if new_length == seg.length:
            return
        tail = seg.length - new_length
        seg.length = new_length
        self._release(seg.end, tail)
        self._after_change()

    # -- accounting -------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self._free_slots

    @property
    def used_slots(self) -> int:
        """Reserved slots, whether or not they hold tokens yet."""
        return self.capacity - self._free_slots

    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)

    def free_blocks(self) -> list[tuple[int, int]]:
        return list(self._free)

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant (explicit raises, so ``python -O`` keeps
        them)."""
        total = 0
        prev_end = -1
        for start, length in self._free:
            if length < 1 or start < 0 or start + length > self.capacity:
                raise AssertionError(f"free block ({start}, {length}) is empty or outside [0, {self.capacity})")
            if start <= prev_end:
                # ``==`` means two adjacent blocks that should have merged; ``<`` an overlap or bad order.
                raise AssertionError(
                    f"free block ({start}, {length}) starts at or before the previous end "
                    f"{prev_end}: free list {self._free}"
                )
            prev_end = start + length
            total += length
        if total != self._free_slots:
            raise AssertionError(f"free blocks hold {total} slots but the counter says {self._free_slots}")
        spans = [(s, n, "free") for s, n in self._free]
        for key, seg in self._live.items():
            if key != seg.start:
                raise AssertionError(f"segment {seg} is tracked under start {key}")
            if seg.length < 1 or not 0 <= seg.used <= seg.length or seg.start < 0 or seg.end > self.capacity:
                raise AssertionError(f"segment {seg} is empty, over-used or outside [0, {self.capacity})")
            spans.append((seg.start, seg.length, "live"))
        spans.sort()
        for (s0, n0, k0), (s1, n1, k1) in zip(spans, spans[1:]):
            if s0 + n0 > s1:
                raise AssertionError(f"{k0} ({s0}, {n0}) overlaps {k1} ({s1}, {n1})")
        covered = sum(n for _, n, _ in spans)
        if covered != self.capacity:
            raise AssertionError(f"live {covered - total} + free {total} slots != capacity {self.capacity}")

    # -- internals --------------------------------------------------------------------------------------

    def _check_live(self, seg: Segment, op: str) -> None:
        if self._live.get(seg.start) is not seg:
            raise ValueError(
                f"cannot {op} segment {seg}: not a live segment of this allocator "
                "(already freed, or handed out elsewhere)"
            )

    def _release(self, start: int, length: int) -> None:
        """Insert a free block, merging with the block that ends at ``start`` and the one that begins at
        its end, so the list never holds two adjacent blocks."""
        i = bisect_left(self._free, (start,))
        end = start + length
        if i < len(self._free) and self._free[i][0] == end:
            end += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start = self._free[i - 1][0]
            self._free[i - 1] = (start, end - start)
        else:
            self._free.insert(i, (start, end - start))
        self._free_slots += length

    def _after_change(self) -> None:
        if self.debug:
            self.check()


@dataclass(slots=True)
class SequenceKV:
    """A request's KV: the shared prefix's segments (read-only here), then its own, in position order.
    New tokens always go into the last own segment."""

    shared: list[Segment]
    own: list[Segment]

    def length(self) -> int:
        return sum(s.used for s in self.shared) + sum(s.used for s in self.own)

    def capacity_left(self) -> int:
        return self.own[-1].free if self.own else 0

    def slots_for_next(self, n: int) -> list[int]:
        """Slot numbers for the next ``n`` tokens (all in the last own segment); does not advance."""
        self._check_room(n)
        if n == 0:
            return []
        first = self.own[-1].start + self.own[-1].used
        return list(range(first, first + n))

    def advance(self, n: int) -> None:
        self._check_room(n)
        if n:
            self.own[-1].used += n

    def ranges(self) -> list[tuple[int, int]]:
        """``(start, end)`` of the used slots, in position order. Empty segments are skipped and a range
        that starts where the previous one ends is merged into it (a segment allocated right after the
        prefix's), so attention reads as few ranges as possible and one range stays a view."""
        out: list[tuple[int, int]] = []
        for seg in (*self.shared, *self.own):
            if seg.used == 0:
                continue
            if out and out[-1][1] == seg.start:
                out[-1] = (out[-1][0], seg.start + seg.used)
            else:
                out.append((seg.start, seg.start + seg.used))
        return out

    def _check_room(self, n: int) -> None:
        if n < 0 or n > self.capacity_left():
            raise ValueError(
                f"{n} tokens do not fit in the last own segment ({self.capacity_left()} free); call grow() first"
            )


class Growth(enum.Enum):
    FITS = "fits"  # the last own segment already had room; nothing changed
    EXTENDED = "extended"  # the last own segment grew in place
    APPENDED = "appended"  # a new own segment was added and is now the last one
    WAIT = "wait"  # no room anywhere; nothing changed (the scheduler waits or preempts)


def grow(alloc: SegmentAllocator, seq: SequenceKV, need: int, chunk: int) -> Growth:
    """Make room for ``need`` more tokens of ``seq`` in its last own segment.

    Extending in place comes first: it keeps the sequence one range. It asks for ``chunk`` extra slots when
    more than the shortfall is wanted, so decode does not come back every token, then for exactly the
    shortfall. Otherwise a new segment of ``max(need, chunk)`` (then ``need``) slots is appended; tokens
    only go into the last segment, so the previous one's unused tail can never be filled and is given back
    (or the whole segment, if it never held a token).
    """
    if need < 1 or chunk < 1:
        raise ValueError(f"need and chunk must be >= 1, got need={need}, chunk={chunk}")
    room = seq.capacity_left()
    if room >= need:
        return Growth.FITS
    if seq.own:
        last = seq.own[-1]
        shortfall = need - room
        for n in sorted({max(shortfall, chunk), shortfall}, reverse=True):
            if alloc.extend(last, n):
                return Growth.EXTENDED
    new = None
    for n in sorted({max(need, chunk), need}, reverse=True):
        new = alloc.allocate(n)
        if new is not None:
            break
    if new is None:
        return Growth.WAIT
    # Allocating before trimming keeps WAIT side-effect free. It loses nothing: extension failed, so the
    # tail plus the free block after it is smaller than ``need`` and could not have held the new segment.
    if seq.own:
        last = seq.own[-1]
        if last.used == 0:
            alloc.free(last)
            seq.own.pop()
        else:
            alloc.shrink(last, last.used)
    seq.own.append(new)
    return Growth.APPENDED


class KVPool:
    """``k[layer]``, ``v[layer]``: ``[capacity, K, Dh]`` tensors, allocated once (``torch.empty``: slots are
    written before they are read). One tensor per layer keeps every slot range a contiguous view."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, capacity, num_kv_heads, head_dim) < 1:
            raise ValueError(
                f"KVPool sizes must be >= 1, got num_layers={num_layers}, capacity={capacity}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        self.num_layers = num_layers
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (capacity, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots_T: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor) -> None:
        """Store T tokens' keys and values at ``slots_T`` (int64 slot numbers, e.g. from
        ``SequenceKV.slots_for_next``)."""
        self.k[layer].index_copy_(0, slots_T, k_TKD)
        self.v[layer].index_copy_(0, slots_T, v_TKD)

    def gather(self, layer: int, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[L, K, Dh]`` of ``ranges`` in order; one range is returned as a view (no copy),
        which is the common case for a sequence that grew in place."""
        k, v = self.k[layer], self.v[layer]
        if len(ranges) == 1:
            start, end = ranges[0]
            return k[start:end], v[start:end]
        if not ranges:
            return k[:0], v[:0]
        return torch.cat([k[s:e] for s, e in ranges]), torch.cat([v[s:e] for s, e in ranges])

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one cached token costs across all layers (K and V): sizes the pool from a memory budget."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))
