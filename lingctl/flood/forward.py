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

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.flood.segment_cache import KVPool
from lingctl.model.ling import LingForCausalLM
from lingctl.flood.experts import StackedExperts, routed_experts
from lingctl.model.moe import SparseMoeBlock

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


@functools.lru_cache(maxsize=4096)
def _causal_mask(q_len: int, keys: int) -> torch.Tensor:
    """Query i (of the unit's last q_len positions) sees keys [0, keys - q_len + i]; bottom-right aligned,
    which SDPA's ``is_causal`` is not when q_len != keys."""
    return torch.ones(q_len, keys, dtype=torch.bool).tril(keys - q_len)


def attention_step(attn: nn.Module, pool: KVPool, layer: int, x_TD: torch.Tensor, positions_T: torch.Tensor,
                   slots_T: torch.Tensor, units: list[AttentionUnit], real: int) -> torch.Tensor:
    """Project, store this step's k/v, then attend unit by unit. Units cover rows ``[0, real)`` in order, so
    their outputs concatenate into the step's rows; padding rows get zeros.

    Batching the decode units into one call over keys gathered and padded to a common length was measured
    (64 requests, 4 layers): the gather cost what the saved calls gained, and each unit's result would
    then depend on the padding rule as well, so units stay one call each."""
    q, k, v = attn.project(x_TD.unsqueeze(0), positions_T.unsqueeze(0))  # q [1,H,T,Dh], k/v [1,K,T,Dh]
    pool.write(layer, slots_T, k[0].transpose(0, 1), v[0].transpose(0, 1))
    k_pool, v_pool = pool.k[layer], pool.v[layer]  # [capacity, K, Dh]
    groups = attn.num_heads // attn.num_kv_heads
    gqa = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
    outs: list[torch.Tensor] = []
    for unit in units:
        ranges = unit.ranges
        if len(ranges) == 1:
            start, end = ranges[0]
            keys_LKD, values_LKD = k_pool[start:end], v_pool[start:end]
        else:
            keys_LKD = torch.cat([k_pool[a:b] for a, b in ranges])
            values_LKD = torch.cat([v_pool[a:b] for a, b in ranges])
        if groups > 1 and not _SDPA_GQA:
            keys_LKD = keys_LKD.repeat_interleave(groups, dim=1)
            values_LKD = values_LKD.repeat_interleave(groups, dim=1)
        mask = _causal_mask(unit.q_len, keys_LKD.shape[0]) if unit.q_len > 1 else None
        outs.append(F.scaled_dot_product_attention(
            q[:, :, unit.q_start:unit.q_start + unit.q_len], keys_LKD.transpose(0, 1).unsqueeze(0),
            values_LKD.transpose(0, 1).unsqueeze(0), attn_mask=mask, **gqa))
    t = x_TD.shape[0]
    if real < t:
        outs.append(q.new_zeros(1, attn.num_heads, t - real, attn.head_dim))
    out_1HTD = torch.cat(outs, dim=2)
    return attn.dense(out_1HTD[0].transpose(0, 1).reshape(t, attn.num_heads * attn.head_dim))


def mlp_step(mlp: nn.Module, x_TD: torch.Tensor, real: int, stacked: StackedExperts | None) -> torch.Tensor:
    """The layer's MLP. Of a MoE layer, only the ``real`` rows are routed: padding rows would otherwise pick
    experts of their own (a one-token step would run up to 4x the experts)."""
    if isinstance(mlp, SparseMoeBlock):
        route = mlp.gate(x_TD)
        y = x_TD.new_zeros(x_TD.shape)
        y[:real] = routed_experts(mlp, stacked, x_TD[:real], route.topk_idx_TK[:real], route.topk_weight_TK[:real],
                                  MIN_ROWS)
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
        self.stacked: dict[int, StackedExperts] = {}
        for i in range(first, last):
            mlp = model.model.layers[i].mlp
            if isinstance(mlp, SparseMoeBlock) and StackedExperts.usable(mlp):
                self.stacked[i] = StackedExperts(mlp, MIN_ROWS)

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
        real = batch.real_tokens or len(batch.token_ids)
        for i in range(self.first, self.last):
            layer = layers[i]
            x = x + attention_step(layer.attention, self.pool, i - self.first, layer.input_layernorm(x),
                                   positions, slots, batch.units, real)
            x = x + mlp_step(layer.mlp, layer.post_attention_layernorm(x), real, self.stacked.get(i))
        if not self.is_last:
            return x
        rows = list(batch.sample_rows)
        n = len(rows)
        if not n:
            return x.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        rows += [rows[-1]] * max(0, MIN_ROWS - n)
        h = self.model.model.norm(x[torch.tensor(rows, dtype=torch.long)])
        return self.model.logits(h)[:n].to(torch.float32)
