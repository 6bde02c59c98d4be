from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lingctl.model.config import LingConfig
from lingctl.model.layers import MLP, Attention, RMSNorm

EPS = 1e-6


def gqa_config(**overrides: object) -> LingConfig:
    """H * head_dim (64) differs from hidden (48) on purpose, so a reshape that assumes they match fails."""
    fields: dict[str, object] = dict(
        vocab_size=64,
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        rope_theta=500.0,
        pad_token_id=0,
        eos_token_id=0,
    )
    fields.update(overrides)
    config = LingConfig(**fields)  # type: ignore[arg-type]
    config.validate()
    return config


# --- RMSNorm ----------------------------------------------------------------------------------------------


def test_rmsnorm_casts_to_input_dtype_before_the_weight() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8) * 0.5 + 2.0)  # far from 1, so (1 + weight) is clearly different
    x = (torch.randn(3, 8) * 3).to(torch.bfloat16)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    out = norm(x)
    assert torch.equal(out, norm.weight * normed)
    assert not torch.allclose(out.float(), ((1 + norm.weight) * normed).float(), atol=1e-2)


def test_rmsnorm_bf16_weight_gives_bf16_output() -> None:
    torch.manual_seed(1)
    norm = RMSNorm(8, EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    norm = norm.to(torch.bfloat16)
    x = torch.randn(2, 5, 8).to(torch.bfloat16)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, norm.weight * normed)


# --- attention --------------------------------------------------------------------------------------------


def rope64(vec: torch.Tensor, pos: float, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of one head vector, angles in float64: pos * theta^(-2i/Dh) for pair i."""
    dh = vec.shape[0]
    half = dh // 2
    i = torch.arange(half, dtype=torch.float64)
    angle = pos * theta ** (-2.0 * i / dh)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = vec[:half], vec[half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def reference_attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor, config: LingConfig) -> torch.Tensor:
    """Ling's attention written out head by head and token by token in float64."""
    h_q, h_kv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = h_q // h_kv
    w = attn.query_key_value.weight.double()
    qkv = x.double() @ w.T
    if attn.query_key_value.bias is not None:
        qkv = qkv + attn.query_key_value.bias.double()
    b, s, _ = x.shape
    heads = torch.zeros(b, s, h_q * dh, dtype=torch.float64)
    for bi in range(b):
        for h in range(h_q):
            g = h // group
            q_cols = slice(h * dh, (h + 1) * dh)
            k_cols = slice(h_q * dh + g * dh, h_q * dh + (g + 1) * dh)
            v_cols = slice((h_q + h_kv) * dh + g * dh, (h_q + h_kv) * dh + (g + 1) * dh)
            for si in range(s):
                q = rope64(qkv[bi, si, q_cols], float(positions[bi, si]), config.rope_theta)
                scores = torch.stack(
                    [
                        q @ rope64(qkv[bi, ti, k_cols], float(positions[bi, ti]), config.rope_theta)
                        for ti in range(si + 1)
                    ]
                ) / math.sqrt(dh)
                p = scores.softmax(dim=0)
                heads[bi, si, q_cols] = sum(p[ti] * qkv[bi, ti, v_cols] for ti in range(si + 1))
    out = heads @ attn.dense.weight.double().T
    if attn.dense.bias is not None:
        out = out + attn.dense.bias.double()
    return out


def test_attention_matches_an_explicit_gqa_reference() -> None:
    torch.manual_seed(0)
    config = gqa_config(use_qkv_bias=True, use_bias=True)
    attn = Attention(config)
    assert attn.dense.in_features == 64
    assert attn.dense.out_features == 48
    x = torch.randn(2, 5, 48)
    # Different positions per row: the tables must follow each row's positions, not the sequence index.
    positions = torch.stack([torch.arange(5), torch.arange(3, 8)])
    expected = reference_attention(attn, x, positions, config)
    with torch.no_grad():
        out = attn(x, positions)
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, expected.float(), atol=1e-5, rtol=0)


def test_attention_kv_head_sharing_is_consecutive() -> None:
    # Query heads 0,1 share KV head 0 and 2,3 share KV head 1 (repeat_interleave, not repeat): zeroing
    # the V rows of KV head 1 must silence exactly query heads 2 and 3.
    torch.manual_seed(2)
    config = gqa_config()
    attn = Attention(config)
    dh, h_q = config.head_dim, config.num_attention_heads
    with torch.no_grad():
        # Start of KV head 1's value rows in the fused weight, laid out [Q heads | K heads | V heads].
        v1 = (h_q + config.num_key_value_heads + 1) * dh
        attn.query_key_value.weight[v1 : v1 + dh].zero_()
        attn.dense.weight.copy_(torch.eye(48, 64))  # pass heads 0..2 (columns 0..47) through unchanged
        out = attn(torch.randn(1, 4, 48), torch.arange(4)[None])
    head = out.view(1, 4, 3, dh)
    assert torch.count_nonzero(head[..., 2, :]) == 0  # query head 2 reads KV head 1
    assert torch.count_nonzero(head[..., 1, :]) > 0  # query head 1 reads KV head 0


def test_rope_projection_at_offset_positions() -> None:
    torch.manual_seed(3)
    attn = Attention(gqa_config())
    x = torch.randn(1, 10, 48)
    with torch.no_grad():
        q_all, k_all, v_all = attn.project(x, torch.arange(10)[None])
        q_tail, k_tail, v_tail = attn.project(x[:, 5:], torch.arange(5, 10)[None])
    assert q_all.shape == (1, 4, 10, 16) and k_all.shape == (1, 2, 10, 16)
    torch.testing.assert_close(q_tail, q_all[:, :, 5:], atol=1e-6, rtol=0)
    torch.testing.assert_close(k_tail, k_all[:, :, 5:], atol=1e-6, rtol=0)
    torch.testing.assert_close(v_tail, v_all[:, :, 5:], atol=1e-6, rtol=0)


def test_rope_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(4)
    attn = Attention(gqa_config())
    x = torch.randn(1, 6, 48)
    with torch.no_grad():
        q0, k0, _ = attn.project(x, torch.arange(6)[None])
        q7, k7, _ = attn.project(x, torch.arange(6)[None] + 7)
    # Query head 0 against KV head 0: shifting every position by 7 leaves q.k unchanged ...
    torch.testing.assert_close(q7[:, 0] @ k7[:, 0].mT, q0[:, 0] @ k0[:, 0].mT, atol=1e-4, rtol=1e-4)
    # ... while the rotated vectors themselves do change (so the check above is not vacuous).
    assert not torch.allclose(q7, q0, atol=1e-3)


# --- MLP --------------------------------------------------------------------------------------------------


def test_mlp_is_swiglu() -> None:
    torch.manual_seed(5)
    mlp = MLP(12, 20)
    x = torch.randn(3, 12)
    gate = x @ mlp.gate_proj.weight.T
    up = x @ mlp.up_proj.weight.T
    expected = (gate * torch.sigmoid(gate) * up) @ mlp.down_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=1e-6, rtol=1e-5)
        # Not GELU-gated: the two activations differ visibly at these magnitudes.
        gelu = (F.gelu(gate) * up) @ mlp.down_proj.weight.T
        assert not torch.allclose(mlp(x), gelu, atol=1e-4)
    assert mlp.gate_proj.bias is None and mlp.up_proj.bias is None and mlp.down_proj.bias is None
