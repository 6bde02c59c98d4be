"""A batch of packed rows as tensors: ids, positions from 0 per block, the blocks attention stays inside, the
targets the loss is taken on, and which block (example, or side of a pair) each token belongs to.

Rows of a batch may differ in length (a curriculum's stage boundary, the last rows of a stage): shorter rows
are padded at the end. Padding is a block of its own that nothing attends to and no loss, auxiliary loss or
expert statistic counts. Attention is computed block by block (``model.layers.Blocks``): a row of many short
examples costs the sum of their squared lengths, where a block-diagonal mask over the whole row would cost the
square of the row's length.

Shape legend: B rows, L tokens per row (the longest row of the batch), S blocks in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lingctl.model.layers import Blocks
from lingctl.train.post.packing import PackedRows

IGNORE = -100


@dataclass(kw_only=True, slots=True)
class PackedBatch:
    input_ids_BL: torch.Tensor  # int64
    positions_BL: torch.Tensor  # int64
    blocks: Blocks  # each row's blocks: attention stays inside each (padding is a block of its own)
    targets_BL: torch.Tensor  # int64: the next token of the block where it is a loss target, else IGNORE
    real_BL: torch.Tensor  # bool: not padding
    block_BL: torch.Tensor  # int64: the batch's block number of each token (padding: -1)
    block_item_S: torch.Tensor  # int64: the item (example or pair) of each block
    block_side_S: torch.Tensor  # int64: 0 an SFT example or a chosen answer, 1 a rejected answer
    n_tokens: int  # real tokens
    split: str = "train"  # whose reference log-probabilities a DPO loss takes: "train" or "eval"

    @property
    def n_blocks(self) -> int:
        return int(self.block_item_S.numel())

    @staticmethod
    def of(rows: PackedRows, indices: list[int] | np.ndarray, split: str = "train") -> PackedBatch:
        starts, ends = rows.row_starts[indices], rows.row_starts[np.asarray(indices) + 1]
        b, length = len(indices), int((ends - starts).max())
        ids = np.zeros((b, length), dtype=np.int64)
        pos = np.zeros((b, length), dtype=np.int64)
        targets = np.full((b, length), IGNORE, dtype=np.int64)
        block = np.full((b, length), -1, dtype=np.int64)
        items: list[int] = []
        sides: list[int] = []
        for i, (r, s, e) in enumerate(zip(indices, starts, ends)):
            n = e - s
            ids[i, :n] = rows.tokens[s:e]
            # Padding positions continue from 0 so they stay valid RoPE positions; nothing reads them.
            pos[i, :n] = rows.positions[s:e]
            pos[i, n:] = np.arange(length - n)
            first = rows.seg_starts[r]
            block[i, :n] = rows.block[s:e] + len(items)
            items.extend(rows.seg_item[first : rows.seg_starts[r + 1]].tolist())
            sides.extend(rows.seg_side[first : rows.seg_starts[r + 1]].tolist())
            # The target of token t is token t + 1 of the same block, when that one is a loss target.
            nxt = rows.tokens[s + 1 : e]
            same = rows.block[s + 1 : e] == rows.block[s : e - 1]
            trained = same & rows.loss_mask[s + 1 : e]
            targets[i, : n - 1] = np.where(trained, nxt, IGNORE)
        block_t = torch.from_numpy(block)
        real = block_t >= 0
        return PackedBatch(
            input_ids_BL=torch.from_numpy(ids),
            positions_BL=torch.from_numpy(pos),
            blocks=Blocks(tuple(_spans(row) for row in block)),
            targets_BL=torch.from_numpy(targets),
            real_BL=real,
            block_BL=block_t,
            block_item_S=torch.tensor(items, dtype=torch.int64),
            block_side_S=torch.tensor(sides, dtype=torch.int64),
            n_tokens=int(real.sum()),
            split=split,
        )


def _spans(block_L: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The runs of equal block numbers in a row (its padding, numbered -1, is the last run)."""
    cuts = np.flatnonzero(block_L[1:] != block_L[:-1]) + 1
    bounds = [0, *cuts.tolist(), len(block_L)]
    return tuple(zip(bounds[:-1], bounds[1:]))
