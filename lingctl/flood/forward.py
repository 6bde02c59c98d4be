"""One forward step of the engine over a flat, varlen batch of tokens, reading and writing the segment KV cache.

A step holds tokens of many sequences side by side (no padding between sequences): decode tokens, prompt
chunks, replayed tokens. Linear layers, norms and experts run on the flat ``[T, D]`` batch; attention runs
per *unit*, one unit being a run of consecutive query tokens of one sequence that attends to the key ranges
of that sequence's segments (prefix segments first, then its own).

Batch invariance: a sequence's tokens must not depend on who shares its step. Three things make that exact on
CPU rather than approximately true:
- every matrix product sees at least ``MIN_ROWS`` rows (flat batch, each expert's slice, the head): BLAS
  takes other kernels for 1-3 rows than for more, while from 4 rows on each row's result is the same bits
  whatever the row count (measured on this machine's torch 2.13 / oneDNN; asserted by the tests);
- attention is computed per unit over exactly the unit's keys, so its shapes depend on the sequence alone;
- prompt chunk boundaries are fixed multiples of the chunk size (scheduler), so a prompt is cut the same way
  whether it runs alone, among 64 others, or after a shared prefix.

Shape legend: T tokens in the step, D hidden, H query heads, K kv heads, Dh head dim, L keys of a unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.flood.segment_cache import KVPool
from lingctl.model.ling import LingForCausalLM
from lingctl.model.moe import SparseMoeBlock, dispatch_sorted

MIN_ROWS = 4
# SDPA reads grouped KV heads in place from torch 2.5; older versions get the heads repeated.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class AttentionUnit:
    """Rows ``[q_start, q_start + q_len)`` of the step are the last ``q_len`` of the keys in ``ranges``."""

    q_start: int
    q_len: int
    ranges: list[tuple[int, int]]  # (start, end) slot ranges in position order

    @property
    def keys(self) -> int:
        return sum(end - start for start, end in self.ranges)


@dataclass(slots=True)
class StepBatch:
    """Everything a stage needs to run one step; plain lists so it pickles small between pipeline stages."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each token's k/v goes; padding rows write to the pool's scratch slot
    units: list[AttentionUnit]
    sample_rows: list[int]  # rows whose logits the scheduler needs, in the order it wants them
    real_tokens: int = 0  # rows before padding
    tag: int = 0  # micro-batch id, echoed back by pipeline stages
    meta: dict = field(default_factory=dict)

    def pad(self, scratch_slot: int) -> None:
        """Pad to ``MIN_ROWS`` rows so the flat products take the many-row kernels."""
        self.real_tokens = len(self.token_ids)
        missing = MIN_ROWS - len(self.token_ids)
        if missing > 0:
            self.token_ids += [0] * missing
            self.positions += [0] * missing
            self.slots += [scratch_slot] * missing


def _causal_mask(q_len: int, keys: int) -> torch.Tensor | None:
    """Query i (of the unit's last q_len positions) sees keys [0, keys - q_len + i]; bottom-right aligned,
    which SDPA's ``is_causal`` is not when q_len != keys."""
    if q_len == 1:
        return None
    return torch.ones(q_len, keys, dtype=torch.bool).tril(keys - q_len)


def attention_step(attn: nn.Module, pool: KVPool, layer: int, x_TD: torch.Tensor, positions_T: torch.Tensor,
                   slots_T: torch.Tensor, units: list[AttentionUnit]) -> torch.Tensor:
    q, k, v = attn.project(x_TD.unsqueeze(0), positions_T.unsqueeze(0))  # q [1,H,T,Dh], k/v [1,K,T,Dh]
    pool.write(layer, slots_T, k[0].transpose(0, 1), v[0].transpose(0, 1))
    q_THD = q[0].transpose(0, 1)
    out_THD = torch.zeros_like(q_THD)
    groups = attn.num_heads // attn.num_kv_heads
    gqa = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
    for unit in units:
        keys_LKD, values_LKD = pool.gather(layer, unit.ranges)
        if groups > 1 and not _SDPA_GQA:
            keys_LKD = keys_LKD.repeat_interleave(groups, dim=1)
            values_LKD = values_LKD.repeat_interleave(groups, dim=1)
        q_1HQD = q_THD[unit.q_start:unit.q_start + unit.q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q_1HQD, keys_LKD.transpose(0, 1).unsqueeze(0), values_LKD.transpose(0, 1).unsqueeze(0),
            attn_mask=_causal_mask(unit.q_len, keys_LKD.shape[0]), **gqa)
        out_THD[unit.q_start:unit.q_start + unit.q_len] = o[0].transpose(0, 1)
    t = x_TD.shape[0]
    return attn.dense(out_THD.reshape(t, attn.num_heads * attn.head_dim))


def mlp_step(mlp: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    if isinstance(mlp, SparseMoeBlock):
        route = mlp.gate(x_TD)
        y = dispatch_sorted(x_TD, route.topk_idx_TK, route.topk_weight_TK, mlp.experts, min_rows=MIN_ROWS)
        if mlp.shared_experts is not None:
            y = y + mlp.shared_experts(x_TD)
        return y
    return mlp(x_TD)


class StageModel:
    """The layers ``[first, last)`` of a model with their KV pools; stage 0 embeds, the last stage adds the
    final norm and the head. One stage holds the whole model in a single process."""

    def __init__(self, model: LingForCausalLM, pool: KVPool, first: int, last: int) -> None:
        self.model = model
        self.pool = pool
        self.first, self.last = first, last
        self.is_first = first == 0
        self.is_last = last == model.config.num_hidden_layers

    @torch.inference_mode()
    def run(self, batch: StepBatch, hidden_TD: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, D] for the next stage, or on the last stage logits [len(sample_rows), V]
        (float32)."""
        positions = torch.tensor(batch.positions, dtype=torch.long)
        slots = torch.tensor(batch.slots, dtype=torch.long)
        if self.is_first:
            x = self.model.model.word_embeddings(torch.tensor(batch.token_ids, dtype=torch.long))
        else:
            assert hidden_TD is not None
            x = hidden_TD
        layers = self.model.model.layers
        for i in range(self.first, self.last):
            layer = layers[i]
            x = x + attention_step(layer.attention, self.pool, i - self.first, layer.input_layernorm(x),
                                   positions, slots, batch.units)
            x = x + mlp_step(layer.mlp, layer.post_attention_layernorm(x))
        if not self.is_last:
            return x
        rows = list(batch.sample_rows)
        n = len(rows)
        if not n:
            return x.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        rows += [rows[-1]] * max(0, MIN_ROWS - n)
        h = self.model.model.norm(x[torch.tensor(rows, dtype=torch.long)])
        return self.model.logits(h)[:n].to(torch.float32)
