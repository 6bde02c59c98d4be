"""The dense building blocks of a Ling layer: RMSNorm, rotary embeddings, fused-QKV attention, SwiGLU MLP.

Shape legend: B batch, S sequence, D hidden, H query heads, K key/value heads, Dh head_dim.
Module and parameter names match Hugging Face ``BailingMoe*`` so state dicts load unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.model.config import LingConfig


class RMSNorm(nn.Module):
    """Normalises in float32, casts back to the input dtype, *then* multiplies by ``weight`` (not 1 + weight),
    exactly as BailingMoeRMSNorm does; the order matters for bf16 results."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [*positions.shape, Dh] for rotate-half RoPE. Angles are computed in float32 even under
    bf16 autocast: bf16 positions times frequencies lose whole radians at long contexts."""
    with torch.autocast(device_type=positions.device.type, enabled=False):
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
        )
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHSDh: torch.Tensor, cos_BSDh: torch.Tensor, sin_BSDh: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BSDh.unsqueeze(1), sin_BSDh.unsqueeze(1)
    return x_BHSDh * cos + rotate_half(x_BHSDh) * sin


@dataclass(frozen=True, slots=True)
class Blocks:
    """Packed rows: each row is a run of blocks (examples) that attend causally within themselves only.
    ``spans[b]``: the ``(start, end)`` of row b's blocks, in order, covering the row. Attention is computed block
    by block, so a row of many short examples costs the sum of their squared lengths, not the row's."""

    spans: tuple[tuple[tuple[int, int], ...], ...]


class Attention(nn.Module):
    """Causal GQA attention with Ling's fused projection, laid out [all Q heads | all K heads | all V heads]."""

    def __init__(self, config: LingConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.query_key_value = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.use_qkv_bias
        )
        # H * Dh may differ from D: `dense` maps the concatenated heads back to the hidden size.
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def project(
        self, x_BSD: torch.Tensor, positions_BS: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B,H,S,Dh], k and v [B,K,S,Dh], with RoPE applied at ``positions``. Split out so an inference
        engine can keep k/v in its own cache and call ``attend`` itself."""
        b, s, _ = x_BSD.shape
        qkv = self.query_key_value(x_BSD).view(b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope_cos_sin(positions_BS, self.head_dim, self.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        mask: torch.Tensor | None = None,
        blocks: Blocks | None = None,
    ) -> torch.Tensor:
        """Attention output projected to [B, S, D]. Query head h uses KV head h // (H / K), hence
        repeat_interleave (each KV head repeated for its consecutive group of query heads)."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        # SDPA's default scale is 1/sqrt(q.shape[-1]) = 1/sqrt(head_dim), as Ling uses.
        if blocks is not None:
            out = _blockwise(q, k, v, blocks)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
        b, _, s, _ = out.shape
        return self.dense(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def forward(self, x_BSD: torch.Tensor, positions_BS: torch.Tensor, blocks: Blocks | None = None) -> torch.Tensor:
        q, k, v = self.project(x_BSD, positions_BS)
        return self.attend(q, k, v, blocks=blocks)


def _blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Causal attention inside each block of each row ([B,H,S,Dh] in and out)."""
    rows = []
    for b, spans in enumerate(blocks.spans):
        parts = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True
            )
            for s, e in spans
        ]
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the dense MLP, each routed expert and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
