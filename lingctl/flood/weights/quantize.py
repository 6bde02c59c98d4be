"""Weight-only int8 quantization of a Ling model for inference.

Every ``nn.Linear`` of the decoder (fused QKV, attention output, dense MLPs, routed and shared experts)
becomes an ``Int8Linear``: symmetric per-output-channel int8 weights, ``w ≈ q * scale[:, None]`` with ``q``
in [-127, 127]: the vector-wise absmax quantization of LLM.int8() (Dettmers et al. 2022) without its
mixed-precision outlier decomposition.

Ling-lite has 16.8B parameters, 33.6 GB in bf16; with int8 linears it needs about 17.3 GB, which fits a
24 GiB machine. Not quantized: the router (``mlp.gate``, tiny, and a flipped top-k choice changes a token's
whole path), embeddings and norms, and by default ``lm_head`` (its errors land directly on the logits).

Shape legend: O output features (rows), I input features, M rows of the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.model.config import LingConfig

QMAX = 127  # symmetric: -128 is never used, so negating a row never overflows
CHUNK_ROWS = 4096  # rows quantized at a time by Int8Linear.from_linear (its one float32 temporary)

# --quantize values: "int8" weight-only; "w8a8" the same int8 weights, and with float32 activations on flood's
# kernels each row of activations quantized to int8 too (one scale per row) for exact integer products.
INT8_MODES = ("int8", "w8a8")


def int8_head(quantize: str | None, dtype: torch.dtype) -> bool:
    """Whether the LM head is made int8 too: with w8a8 and float32 activations, where flood's kernels multiply
    it (a float32 head is a third of what a Ling-lite decode step reads, and its oneDNN copy as much again);
    with bfloat16 activations it would be widened on every call, so it stays in float."""
    return quantize == "w8a8" and dtype == torch.float32


def native_kernels() -> Any:
    """flood's native kernels when they are built and enabled (see lingctl.flood.engine.native), else None."""
    from lingctl.flood.engine.native import kernels

    return kernels()


def quantize_rows(w_OI: torch.Tensor, dtype: torch.dtype, out_OI: torch.Tensor) -> torch.Tensor:
    """Quantize the rows ``w_OI`` (any float dtype) into ``out_OI`` (float32, same shape): integral values
    in [-QMAX, QMAX]; return the scales in ``dtype``. Each row is treated alone, so any split of a matrix into
    row chunks gives the same bits; every quantizer of the package (``Int8Linear.from_linear``, the streaming
    loader) goes through here. The absmax is taken on ``w_OI`` as it is (a max is exact in any dtype) and the
    division reads it widened to float32 on the fly, so a 16-bit source is never copied to float32 first."""
    amax = torch.maximum(torch.amax(w_OI, dim=1), -torch.amin(w_OI, dim=1)).to(torch.float32)
    # Round the scale to its stored dtype first and quantize against that, so the rounding of a bf16 scale
    # cannot add to the error: |w - q*scale| <= scale/2 per element.
    scale = (amax / QMAX).to(dtype)
    scale = scale.masked_fill(scale == 0, 1.0)  # all-zero row (or an underflowed scale): q = 0
    torch.div(w_OI, scale.to(torch.float32)[:, None], out=out_OI).round_().clamp_(-QMAX, QMAX)  # half to even
    return scale


class Int8Linear(nn.Module):
    """Symmetric per-output-channel int8 weights: w ≈ q * scale[:, None], q int8 in [-127, 127].

    ``weight_q``, ``scale`` and ``bias`` are buffers, so they follow ``.to(device)`` and the state dict but
    are never trained. ``weight`` is a read-only dequantised copy for code that reads a linear's matrix
    directly (the ``grouped`` MoE dispatch stacks expert weights; ``head_weight`` reads ``lm_head.weight``);
    writing into it changes nothing.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"Int8Linear: dtype for scales and bias must be floating point, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight_q: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight_q", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        # w8a8: on flood's kernels, quantize each input row to int8 too (a plain attribute, not saved).
        self.act_int8 = False

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype, *, rows_per_chunk: int = CHUNK_ROWS) -> Int8Linear:
        """Quantize ``linear`` row chunk by row chunk: the only float32 temporary is one chunk of
        ``rows_per_chunk`` x I, so a weight mmap'd from a huge bf16 checkpoint is never copied whole."""
        if rows_per_chunk <= 0:
            raise ValueError(f"rows_per_chunk must be positive, got {rows_per_chunk}")
        w_OI = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, device=w_OI.device)
        for r0 in range(0, linear.out_features, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, linear.out_features)
            chunk = torch.empty(r1 - r0, linear.in_features, dtype=torch.float32, device=w_OI.device)
            scale = quantize_rows(w_OI[r0:r1], dtype, chunk)
            out.weight_q[r0:r1] = chunk.to(torch.int8)
            out.scale[r0:r1] = scale
        if linear.bias is not None:
            assert out.bias is not None
            out.bias.copy_(linear.bias.to(dtype))
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised matrix [O, I] in the scale dtype (a fresh tensor on every access)."""
        return self.weight_q.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = native_kernels() if x.device.type == "cpu" and self.weight_q.is_contiguous() else None
        if native is not None and x.dtype == torch.float32 and x.numel():
            # flood's int8 kernel: each weight row is read once for all rows of x and widened in registers;
            # every output is a fixed-order sum, so a row's result depends neither on the batch nor on the
            # thread count. float32 activations only: bfloat16 ones keep torch's bf16 products below, which
            # use the CPU's BF16 instructions where it has them (measured faster than widening to float32).
            bias = self.bias.to(torch.float32) if self.bias is not None else None
            x2 = x.reshape(-1, self.in_features)
            y = native.linear_q8(x2, self.weight_q, self.scale.to(torch.float32), bias, act_int8=self.act_int8)
            return y.reshape(*x.shape[:-1], self.out_features)
        # Without the kernels: the int8 matrix is widened to x's dtype on every call, a temporary the size of
        # the layer in that dtype (one layer at a time, so peak memory grows by the largest layer, not the
        # model); the widening is exact (|q| <= 127 fits bf16's 8-bit mantissa) and costs a pass over the
        # weight, which decode steps pay anyway to read it.
        if x.dtype == torch.float16:
            # Unscaled q sums can pass float16's 65504 for wide layers; fold the scale in first.
            y = F.linear(x, self.weight_q.to(x.dtype) * self.scale.to(x.dtype)[:, None])
        else:
            y = F.linear(x, self.weight_q.to(x.dtype))
            y = y * self.scale.to(y.dtype)
        # Both steps treat each row of x alone, so a row's result never depends on the rest of the batch
        # beyond what the matmul kernel itself does.
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scale_dtype={self.scale.dtype}"
        )


@dataclass(kw_only=True, slots=True)
class QuantizeReport:
    """What ``quantize_model_`` did. ``params`` counts weight elements made int8 (biases stay in float);
    the byte counts cover every parameter and buffer of the whole model, before and after."""

    layers: int
    params: int
    bytes_before: int
    bytes_after: int


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each shared tensor (a tied head) counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def eligible_linears(model: nn.Module, include_head: bool) -> list[str]:
    head: nn.Module | None = getattr(model, "lm_head", None)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is head and (not include_head or id(module.weight) in embeddings):
            # A tied head shares the embedding matrix: an int8 copy would add bytes, not save them.
            continue
        names.append(name)
    return names


@torch.no_grad()
def quantize_model_(model: nn.Module, dtype: torch.dtype, *, include_head: bool = False) -> QuantizeReport:
    """Replace every eligible ``nn.Linear`` of ``model`` by an ``Int8Linear`` with scales and bias in
    ``dtype``, in place. The router (a ``Router``, not an ``nn.Linear``), embeddings and norms are left as
    they are; cast the model to the serving dtype before quantizing (cheaper than after).

    Each original linear is released as soon as its replacement is in place, so the peak is about the int8
    model plus one float32 chunk plus whatever of the float model is still to go (nothing, when the float
    weights are mmap'd from disk).

    With ``include_head`` a NormHead model has its normalisation baked into ``lm_head`` first (as for any
    inference), since ``head_weight`` would otherwise renormalise the dequantised matrix on every call.
    """
    bytes_before = model_bytes(model)
    names = eligible_linears(model, include_head)
    normalize_head = getattr(model, "normalize_head_", None)
    if include_head and "lm_head" in names and normalize_head is not None:
        normalize_head()
    layers = params = 0
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        setattr(parent, child, Int8Linear.from_linear(linear, dtype))
        params += linear.weight.numel()
        layers += 1
        del linear  # the last reference: its weight is freed here, not at the end of the walk
    return QuantizeReport(layers=layers, params=params, bytes_before=bytes_before, bytes_after=model_bytes(model))


# -- size estimates from the config alone ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _LinearShape:
    out_features: int
    in_features: int
    bias: bool
    count: int  # how many such linears the model has


def _linear_shapes(config: LingConfig) -> list[_LinearShape]:
    """Every decoder linear of ``LingForCausalLM`` (lm_head excluded), grouped by shape."""
    d, layers = config.hidden_size, config.num_hidden_layers
    q_width = config.num_attention_heads * config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    n_dense = config.first_k_dense_replace
    n_moe = layers - n_dense
    shapes = [_LinearShape(qkv, d, config.use_qkv_bias, layers), _LinearShape(d, q_width, config.use_bias, layers)]

    def swiglu(width: int, count: int) -> list[_LinearShape]:
        return [_LinearShape(width, d, False, 2 * count), _LinearShape(d, width, False, count)]

    if n_dense:
        shapes += swiglu(config.intermediate_size, n_dense)
    if n_moe:
        shapes += swiglu(config.moe_intermediate_size, n_moe * config.num_experts)
        if config.num_shared_experts:
            shapes += swiglu(config.moe_intermediate_size * config.num_shared_experts, n_moe)
    return [s for s in shapes if s.count and s.out_features and s.in_features]


def _other_params(config: LingConfig) -> int:
    """Parameters outside the decoder linears and lm_head: embeddings, norms, routers."""
    d, layers = config.hidden_size, config.num_hidden_layers
    routers = (layers - config.first_k_dense_replace) * config.num_experts * d
    return config.vocab_size * d + layers * 2 * d + d + routers


def dense_weight_bytes(config: LingConfig, dtype: torch.dtype) -> int:
    """Bytes of ``LingForCausalLM(config)``'s weights with every tensor in ``dtype``."""
    linear = sum(
        s.count * (s.out_features * s.in_features + (s.out_features if s.bias else 0)) for s in _linear_shapes(config)
    )
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return (linear + _other_params(config) + head) * dtype.itemsize


def int8_weight_bytes(config: LingConfig, dtype: torch.dtype, *, include_head: bool = False) -> int:
    """Bytes of the same model after ``quantize_model_(model, dtype, include_head=...)`` on a model whose
    other tensors are in ``dtype``: int8 matrices, one ``dtype`` scale per output row, biases in ``dtype``."""
    size = dtype.itemsize
    linear = sum(
        s.count * (s.out_features * s.in_features + size * s.out_features * (1 + s.bias))
        for s in _linear_shapes(config)
    )
    v, d = config.vocab_size, config.hidden_size
    if config.tie_word_embeddings:
        head = 0  # shares the embedding, which stays in dtype
    elif include_head:
        head = v * d + v * size
    else:
        head = v * d * size
    return linear + _other_params(config) * size + head
