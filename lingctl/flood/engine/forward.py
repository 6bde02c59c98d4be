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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.flood.engine.experts import StackedExperts, routed_experts
from lingctl.flood.engine.native import Kernels, UnitTable, kernels
from lingctl.flood.engine.packed import PackedLinear
from lingctl.flood.engine.packed import available as packed_available
from lingctl.flood.engine.segment_cache import KVPool
from lingctl.flood.weights.quantize import Int8Linear
from lingctl.model.layers import MLP, Attention, apply_rope, rope_cos_sin
from lingctl.model.ling import DecoderLayer, LingForCausalLM
from lingctl.model.moe import Router, SparseMoeBlock

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


@dataclass(slots=True)
class NativeUnits:
    """A step's attention units as the native kernel reads them, built and checked once per step and used by
    every layer: ``table`` rows (q_start, q_len, key offset, key count) into its keys, the units' slots in
    order."""

    kernels: Kernels
    table: UnitTable

    @staticmethod
    def build(native: Kernels, units: list[AttentionUnit]) -> NativeUnits:
        rows: list[int] = []
        keys: list[int] = []
        longest = 0
        for unit in units:
            n = unit.keys
            rows += (unit.q_start, unit.q_len, len(keys), n)
            for a, b in unit.ranges:
                keys.extend(range(a, b))
            longest = max(longest, n)
        units_U4 = torch.tensor(rows, dtype=torch.long).view(-1, 4)
        return NativeUnits(kernels=native, table=UnitTable.of(units_U4, torch.tensor(keys, dtype=torch.long), longest))


def rope_tables(positions_T: torch.Tensor, attn: Attention, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, Dh] for the step's positions: the same for every layer, so computed once per step (the
    model's own ``project`` recomputes them per layer)."""
    cos, sin = rope_cos_sin(positions_T, attn.head_dim, attn.rope_theta, dtype)
    return cos.unsqueeze(0), sin.unsqueeze(0)  # [1, T, Dh], broadcast over heads as apply_rope expects


Linear = Callable[[torch.Tensor], torch.Tensor]


def project(
    attn: Attention, qkv_proj: Linear, x_TD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Attention.project`` with precomputed rotary tables: q [H, T, Dh], k and v [K, T, Dh]."""
    t = x_TD.shape[0]
    qkv = qkv_proj(x_TD).view(t, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
    q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return apply_rope(q[None], cos, sin)[0], apply_rope(k[None], cos, sin)[0], v


def rowwise(linear: Linear | nn.Module | None, x: torch.Tensor) -> bool:
    """Whether ``linear``'s products on ``x`` are flood's int8 kernels, which compute every row alone in a fixed
    order whatever the row count: there, padding rows (``MIN_ROWS``) buy no invariance and cost real work (a
    one-token decode step would multiply 4 rows: twice the time of one in the w8a8 kernels, measured)."""
    return (
        isinstance(linear, Int8Linear)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and linear.weight_q.is_contiguous()
        and kernels() is not None
    )


def real_rows(linear: Linear, x_TD: torch.Tensor, real: int) -> torch.Tensor:
    """``linear(x_TD)``, computing only the first ``real`` rows where ``rowwise`` holds (padding rows are zeros)."""
    if real >= x_TD.shape[0] or not rowwise(linear, x_TD):
        return linear(x_TD)
    y = x_TD.new_zeros(x_TD.shape[0], cast(Int8Linear, linear).out_features)
    y[:real] = linear(x_TD[:real])
    return y


def attention_step(
    attn: Attention,
    ops: LayerOps,
    pool: KVPool,
    layer: int,
    x_TD: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots_T: torch.Tensor,
    units: list[AttentionUnit],
    real: int,
    native: NativeUnits | None = None,
) -> torch.Tensor:
    """Project, store this step's k/v, then attend unit by unit. Units cover rows ``[0, real)`` in order, so
    their outputs concatenate into the step's rows; padding rows get zeros.

    Batching the decode units into one call over keys gathered and padded to a common length was measured
    twice (64 requests, 4 layers; the second time with ``index_select``, 6x faster than indexing, and
    padding per unit so results stay batch-free): a batched SDPA over 20 one-token queries cost what 20
    separate calls do (256 vs 227 us) and the gather came on top, so units stay one call each."""
    q_HTD, k_KTD, v_KTD = project(attn, functools.partial(real_rows, ops.qkv, real=real), x_TD, cos, sin)
    pool.write(layer, slots_T, k_KTD.transpose(0, 1), v_KTD.transpose(0, 1))
    k_pool, v_pool = pool.k[layer], pool.v[layer]  # [capacity, K, Dh]
    if native is not None:
        t = x_TD.shape[0]
        q_THD = q_HTD.transpose(0, 1).contiguous()
        out_THD = q_THD.new_zeros(t, attn.num_heads, attn.head_dim)
        native.kernels.attention(q_THD, k_pool, v_pool, native.table, attn.head_dim**-0.5, out_THD)
        return real_rows(ops.dense, out_THD.view(t, attn.num_heads * attn.head_dim), real)
    groups = attn.num_heads // attn.num_kv_heads
    gqa = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
    q = q_HTD.unsqueeze(0)
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
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, unit.q_start : unit.q_start + unit.q_len],
                keys_LKD.transpose(0, 1).unsqueeze(0),
                values_LKD.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                **gqa,
            )
        )
    t = x_TD.shape[0]
    if real < t:
        outs.append(q.new_zeros(1, attn.num_heads, t - real, attn.head_dim))
    out_1HTD = torch.cat(outs, dim=2)
    return real_rows(ops.dense, out_1HTD[0].transpose(0, 1).reshape(t, attn.num_heads * attn.head_dim), real)


class FusedMLP:
    """A float SwiGLU ``MLP`` (dense layer or shared expert) with gate and up fused input-major, ``[D, 2W]``,
    and down ``[W, D]``: two products instead of three, each reading its weight row-major. The module's
    parameters become views of these (no second copy)."""

    def __init__(self, mlp: MLP) -> None:
        w = mlp.gate_proj.out_features
        with torch.no_grad():
            gate_up_DX = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t().contiguous()
            down_WD = mlp.down_proj.weight.t().contiguous()
            mlp.gate_proj.weight = nn.Parameter(gate_up_DX[:, :w].t(), requires_grad=False)
            mlp.up_proj.weight = nn.Parameter(gate_up_DX[:, w:].t(), requires_grad=False)
            mlp.down_proj.weight = nn.Parameter(down_WD.t(), requires_grad=False)
        self.width = w
        self.gate_up = PackedLinear(gate_up_DX.t())
        self.down = PackedLinear(down_WD.t())

    @staticmethod
    def usable(mlp: MLP) -> bool:
        return (
            all(type(getattr(mlp, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))
            and mlp.gate_proj.bias is None
            and mlp.down_proj.bias is None
            and mlp.gate_proj.weight.device.type != "meta"
        )

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x_TD)
        return self.down(F.silu(h[:, : self.width]) * h[:, self.width :])


def _input_major(linear: nn.Module) -> None:
    """Store a float linear's weight as ``[in, out]`` contiguous (``weight`` stays its ``[out, in]`` view), so
    ``F.linear`` reads it row-major: faster on weights that are not in cache; the same values to rounding
    (bit for bit in the shapes measured), and a row's result still does not depend on the other rows."""
    if type(linear) is not nn.Linear:
        return
    w = linear.weight
    if w.device.type == "meta" or w.dim() != 2 or w.t().is_contiguous():
        return
    with torch.no_grad():
        linear.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)


def _fast(linear: nn.Module) -> Linear:
    """The packed form of a float linear, else the module itself (int8 layers). The input-major copy only
    pays where products go through ``F.linear`` (no oneDNN): packing reads the weight in any layout."""
    if not packed_available():
        _input_major(linear)
    packed = PackedLinear.of(linear)
    return packed if packed is not None else linear


@dataclass(slots=True)
class LayerOps:
    qkv: Linear
    dense: Linear


def _mlp(mlp: MLP, fused: FusedMLP | None, x_TD: torch.Tensor) -> torch.Tensor:
    return fused(x_TD) if fused is not None else mlp(x_TD)


class PackedRouter:
    """``Router.forward`` for inference (no warmup noise) with the router's product packed like the other
    linears: the same softmax in float32, top-k and renormalisation."""

    def __init__(self, gate: Router) -> None:
        self.linear = PackedLinear(gate.weight)
        self.top_k = gate.top_k
        self.norm_topk_prob = gate.norm_topk_prob

    @staticmethod
    def usable(gate: Router) -> bool:
        return (
            gate.weight.device.type == "cpu"
            and gate.weight.dtype in (torch.float32, torch.bfloat16)
            and getattr(gate, "warmup_alpha", 1.0) >= 1.0
        )

    def __call__(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.linear(x_TD).to(torch.float32).softmax(dim=-1)
        weight, idx = torch.topk(probs, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight


def mlp_step(
    mlp: SparseMoeBlock | MLP,
    x_TD: torch.Tensor,
    real: int,
    stacked: StackedExperts | None,
    fused: FusedMLP | None,
    router: PackedRouter | None = None,
) -> torch.Tensor:
    """The layer's MLP. Of a MoE layer, only the ``real`` rows are routed: padding rows would otherwise pick
    experts of their own (a one-token step would run up to 4x the experts). ``fused`` is the shared expert
    of a MoE layer, or the MLP of a dense one."""
    if isinstance(mlp, SparseMoeBlock):
        if router is not None:
            idx_TK, weight_TK = router(x_TD)
        else:
            route = mlp.gate(x_TD)
            idx_TK, weight_TK = route.topk_idx_TK, route.topk_weight_TK
        y = x_TD.new_zeros(x_TD.shape)
        y[:real] = routed_experts(mlp, stacked, x_TD[:real], idx_TK[:real], weight_TK[:real], MIN_ROWS)
        shared = mlp.shared_experts
        if shared is not None and fused is None and real < x_TD.shape[0] and rowwise(shared.down_proj, x_TD):
            y[:real] = y[:real] + shared(x_TD[:real])  # int8 kernels: the padding rows are not computed
        elif shared is not None:
            y = y + _mlp(shared, fused, x_TD)
        return y
    return _mlp(mlp, fused, x_TD)


class StageModel:
    """The layers ``[first, last)`` of a model with their KV pools; stage 0 embeds, the last stage adds the
    final norm and the head. One stage holds the whole model in a single process.

    Building one rearranges the float weights of its layers for inference (input-major, gate and up fused,
    experts stacked); the model computes the same function afterwards and its parameters keep their names."""

    def __init__(self, model: LingForCausalLM, pool: KVPool, first: int, last: int) -> None:
        self.model = model
        self.pool = pool
        self.first, self.last = first, last
        self.is_first = first == 0
        self.is_last = last == model.config.num_hidden_layers
        self.stacked: dict[int, StackedExperts] = {}
        self.fused: dict[int, FusedMLP] = {}
        self.routers: dict[int, PackedRouter] = {}
        self.ops: dict[int, LayerOps] = {}
        for i in range(first, last):
            layer = cast(DecoderLayer, model.model.layers[i])  # ModuleList items are typed as plain Modules
            self.ops[i] = LayerOps(qkv=_fast(layer.attention.query_key_value), dense=_fast(layer.attention.dense))
            mlp = layer.mlp
            if isinstance(mlp, SparseMoeBlock):
                if StackedExperts.usable(mlp):
                    self.stacked[i] = StackedExperts(mlp, MIN_ROWS)
                if PackedRouter.usable(mlp.gate):
                    self.routers[i] = PackedRouter(mlp.gate)
                dense = mlp.shared_experts
            else:
                dense = mlp
            if dense is not None and FusedMLP.usable(dense):
                self.fused[i] = FusedMLP(dense)
        # float32 attention through the native kernel (all units, so results stay batch-free)
        self.native = kernels() if pool.dtype == torch.float32 else None
        self.head: Linear | None = None
        if self.is_last and not model.config.norm_head:
            # (NormHead is baked in by loaders; an unbaked head is normalised per call by ``logits``.)
            # (an int8 head is checked by type: reading its .weight would dequantize the whole head)
            if isinstance(model.lm_head, Int8Linear) or model.lm_head.weight is not model.model.word_embeddings.weight:
                self.head = _fast(model.lm_head)
            else:
                self.head = PackedLinear.of(model.lm_head)

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
        cos = sin = None
        native = (
            NativeUnits.build(self.native, batch.units)
            if self.native is not None and x.dtype == torch.float32
            else None
        )
        for i in range(self.first, self.last):
            layer = cast(DecoderLayer, layers[i])
            h = layer.input_layernorm(x)
            if cos is None:
                cos, sin = rope_tables(positions, layer.attention, h.dtype)
            assert sin is not None
            x = x + attention_step(
                layer.attention, self.ops[i], self.pool, i - self.first, h, cos, sin, slots, batch.units, real, native
            )
            x = x + mlp_step(
                layer.mlp,
                layer.post_attention_layernorm(x),
                real,
                self.stacked.get(i),
                self.fused.get(i),
                self.routers.get(i),
            )
        if not self.is_last:
            return x
        rows = list(batch.sample_rows)
        n = len(rows)
        if not n:
            return x.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        if not rowwise(self.head, x):
            rows += [rows[-1]] * max(0, MIN_ROWS - n)
        h = self.model.model.norm(x[torch.tensor(rows, dtype=torch.long)])
        logits = self.head(h) if self.head is not None else self.model.logits(h)
        return logits[:n].to(torch.float32)
