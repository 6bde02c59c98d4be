"""Packing fine-tuning examples into rows, and the length curriculum.

Examples of different lengths are packed into rows of at most ``seq_len`` tokens (best fit, longest first), each
example a block of its own: the batch (``batch.py``) gives every block its own positions from 0 and lets no
token attend outside its block, so a packed row computes what its examples would compute one by one, without
the padding a batch of unequal examples otherwise carries. A preference pair keeps its chosen and rejected
answers in one row, each in its own block, so a batch always holds both sides of its pairs.

The curriculum (``--seq-len-schedule 4096,16384@0.05``, Ling's long-context fine-tuning): the first stage
trains on the examples that fit 4,096 tokens, in rows of 4,096; the next on rows of 16,384 holding the
examples of 4,097-16,384 tokens mixed with short ones at 95:5 short to long, in examples. The stages
run in order, each shuffled on its own, every epoch.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from lingctl.core.errors import UsageError
from lingctl.runs.train_config import Stage

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class PackedRows:
    """Rows of packed blocks, stored flat. Row ``r`` holds tokens ``row_starts[r]:row_starts[r+1]`` and
    blocks ``seg_starts[r]:seg_starts[r+1]`` of the block tables; a block is one example or one side of a pair
    (``seg_item``: its index in the item list; ``seg_side``: 0 chosen or an SFT example, 1 rejected)."""

    tokens: np.ndarray  # int32, flat
    loss_mask: np.ndarray  # bool, flat: the token is a loss target
    positions: np.ndarray  # int32, flat: from 0 in each block
    block: np.ndarray  # int32, flat: the block's number within its row
    row_starts: np.ndarray  # int64 [R + 1]
    seg_starts: np.ndarray  # int64 [R + 1]
    seg_item: np.ndarray  # int64 [blocks]
    seg_side: np.ndarray  # int8 [blocks]
    stage_rows: list[int]  # rows per curriculum stage, in order
    n_items: int

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _units(items: list[Any]) -> list[list[Any]]:
    """The blocks that must share a row: an example alone, or a pair's two answers."""
    return [[item.chosen, item.rejected] if hasattr(item, "chosen") else [item] for item in items]


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of ``capacity``: longest first, each into the fullest bin it
    fits (ties: the earliest bin), so the result depends on the lengths alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    bins: list[list[int]] = []
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


def _stage_units(lengths: list[int], stages: list[Stage], seed: int) -> list[list[int]]:
    """Per stage, the units it trains on (indices): the first stage its short units; a later one its own long
    units plus short ones (from earlier stages, a seeded draw) so that the long ones are the stage's fraction of
    its examples (Ling's 95:5 short-to-long sample ratio)."""
    out: list[list[int]] = []
    bound = 0
    short: list[int] = []
    for s, stage in enumerate(stages):
        own = [i for i, n in enumerate(lengths) if bound < n <= stage.seq_len]
        if stage.long_fraction is None or not own or not short:
            chosen = own
        else:
            want = round(len(own) * (1 - stage.long_fraction) / stage.long_fraction)
            draw = np.random.default_rng([seed, s]).permutation(len(short))
            chosen = own + [short[draw[k % len(short)]] for k in range(want)]
        out.append(chosen)
        short += own
        bound = stage.seq_len
    return out


def pack(items: list[Any], stages: list[Stage], *, seed: int = 0, what: str = "examples") -> PackedRows:
    """``items`` (Examples or Pairs) packed into rows, stage by stage; an item longer than the last stage's
    rows is left out with a warning."""
    units = _units(items)
    lengths = [sum(len(x) for x in u) for u in units]
    limit = stages[-1].seq_len
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if too_long:
        first = items[too_long[0]].where
        log.warning(
            "%d of %d %s are longer than %d tokens and are left out (the first: %s, %d tokens); raise --seq-len",
            len(too_long), len(items), what, limit, first, lengths[too_long[0]],
        )  # fmt: skip
        if len(too_long) == len(items):
            raise UsageError(f"every one of the {what} is longer than {limit} tokens", hint="raise --seq-len")
    tokens: list[np.ndarray] = []
    loss: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    block: list[np.ndarray] = []
    row_starts, seg_starts = [0], [0]
    seg_item: list[int] = []
    seg_side: list[int] = []
    stage_rows = []
    for stage, members in zip(stages, _stage_units(lengths, stages, seed)):
        bins = best_fit([lengths[i] for i in members], stage.seq_len)
        for b in bins:
            for m in sorted(members[j] for j in b):
                for side, seq in enumerate(units[m]):
                    n = len(seq)
                    tokens.append(np.asarray(seq.ids, dtype=np.int32))
                    loss.append(np.asarray(seq.loss_mask, dtype=bool))
                    positions.append(np.arange(n, dtype=np.int32))
                    block.append(np.full(n, len(seg_item) - seg_starts[-1], dtype=np.int32))
                    seg_item.append(m)
                    seg_side.append(side)
            row_starts.append(row_starts[-1] + sum(lengths[members[j]] for j in b))
            seg_starts.append(len(seg_item))
        stage_rows.append(len(bins))

    def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)

    return PackedRows(
        tokens=cat(tokens, np.int32),
        loss_mask=cat(loss, bool),
        positions=cat(positions, np.int32),
        block=cat(block, np.int32),
        row_starts=np.asarray(row_starts, dtype=np.int64),
        seg_starts=np.asarray(seg_starts, dtype=np.int64),
        seg_item=np.asarray(seg_item, dtype=np.int64),
        seg_side=np.asarray(seg_side, dtype=np.int8),
        stage_rows=stage_rows,
        n_items=len(items),
    )


class StagedOrder:
    """The batch order of a curriculum: every epoch, the first stage's rows (shuffled), then the next stage's
    (shuffled), and so on; a pure function of the seed and the position, as ``data.BatchOrder``."""

    def __init__(self, stage_rows: list[int], seed: int) -> None:
        self.stage_rows = [n for n in stage_rows]
        self.n_rows = sum(stage_rows)
        if self.n_rows < 1:
            raise ValueError("StagedOrder needs at least one row")
        self.seed = seed
        self._epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            parts, start = [], 0
            for s, n in enumerate(self.stage_rows):
                parts.append(start + np.random.default_rng([self.seed, epoch, s]).permutation(n))
                start += n
            self._order = np.concatenate(parts)
            self._epoch = epoch
        return self._order

    def indices(self, cursor: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            epoch, offset = divmod(cursor + k, self.n_rows)
            out[k] = self._epoch_order(epoch)[offset]
        return out
