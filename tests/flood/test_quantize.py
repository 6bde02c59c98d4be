from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lingctl.flood.weights.quantize import (
    Int8Linear,
    dense_weight_bytes,
    int8_weight_bytes,
    model_bytes,
    quantize_model_,
)
from lingctl.model.config import LingConfig
from lingctl.model.ling import DecoderLayer, LingForCausalLM
from lingctl.model.moe import Router, grouped_mm_available
from lingctl.model.presets import preset


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny tensors gain nothing from intra-op threads; on a busy machine their spinning slows every op.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(config: LingConfig | None = None, dtype: torch.dtype = torch.float32) -> LingForCausalLM:
    model = LingForCausalLM(config or preset("tiny"))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to(dtype).eval()


def token_batch(vocab: int, batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def linear_names(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity of the flattened logits, share of positions with the same argmax)."""
    cos = F.cosine_similarity(ref.float().flatten(), got.float().flatten(), dim=0).item()
    same = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    return cos, same


# --- what gets replaced -------------------------------------------------------------------------------------


def test_every_eligible_linear_replaced_router_head_and_embeddings_untouched() -> None:
    model = tiny_model()
    ref = copy.deepcopy(model)
    eligible = {name: m for name, m in linear_names(ref).items() if name != "lm_head"}
    report = quantize_model_(model, torch.float32)

    modules = dict(model.named_modules())
    assert report.layers == len(eligible)
    assert report.params == sum(m.weight.numel() for m in eligible.values())
    for name in eligible:
        assert isinstance(modules[name], Int8Linear), name
    assert list(linear_names(model)) == ["lm_head"]
    # Every kind the brief names is among them: attention, dense MLP, routed and shared experts.
    for part in (
        "attention.query_key_value",
        "attention.dense",
        "layers.0.mlp.gate_proj",
        "mlp.experts.7.down_proj",
        "mlp.shared_experts.up_proj",
    ):
        assert any(part in name for name in eligible), part

    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert torch.equal(model.model.word_embeddings.weight, ref.model.word_embeddings.weight)
    routers, ref_routers = model.routers(), ref.routers()
    assert len(routers) == 1 and all(type(r) is Router for r in routers)
    for r, r0 in zip(routers, ref_routers):
        assert isinstance(r.weight, nn.Parameter) and torch.equal(r.weight, r0.weight)


def test_report_bytes_are_the_model_totals() -> None:
    model = tiny_model()
    before = model_bytes(model)
    rows = sum(m.out_features for name, m in linear_names(model).items() if name != "lm_head")
    report = quantize_model_(model, torch.float32)
    assert report.bytes_before == before
    assert report.bytes_after == model_bytes(model)
    # Each float32 weight element becomes one byte; each row gains a float32 scale.
    assert report.bytes_before - report.bytes_after == 3 * report.params - 4 * rows


def test_include_head_quantizes_the_baked_norm_head() -> None:
    model = tiny_model()
    ids = token_batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(ids).logits
    report = quantize_model_(model, torch.float32, include_head=True)
    assert isinstance(model.lm_head, Int8Linear)
    assert model.config.norm_head is False  # baked in before quantizing, not reapplied per call
    assert report.bytes_after == int8_weight_bytes(model.config, torch.float32, include_head=True)
    with torch.no_grad():
        cos, same = agreement(ref, model(ids).logits)
    assert cos > 0.99 and same > 0.9


def test_tied_head_is_left_shared_with_the_embedding() -> None:
    model = tiny_model(dataclasses.replace(preset("tiny"), tie_word_embeddings=True))
    quantize_model_(model, torch.float32, include_head=True)
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.word_embeddings.weight


# --- accuracy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_each_row_error_is_within_half_a_step(dtype: torch.dtype) -> None:
    model = tiny_model(dtype=dtype)
    ref = linear_names(copy.deepcopy(model))
    quantize_model_(model, dtype)
    worst = 0.0
    for name, q in model.named_modules():
        if not isinstance(q, Int8Linear):
            continue
        w = ref[name].weight.detach().float()
        assert q.weight_q.dtype == torch.int8 and int(q.weight_q.abs().max()) <= 127
        # What forward computes: q times the stored scale, exactly (no rounding of the product to dtype).
        dequant = q.weight_q.float() * q.scale.float()[:, None]
        row_max = w.abs().amax(dim=1)
        err = (dequant - w).abs().amax(dim=1)
        assert torch.all(err <= row_max / 127), name
        worst = max(worst, float((err / row_max).max()))
    # Rounding to the nearest step is at most half a step, max/254; a bf16 scale may be up to 2^-8 larger
    # than max/127.
    assert worst <= 0.5 / 127 * (1 + 2**-8)


def test_quantized_logits_follow_the_float_model() -> None:
    model = tiny_model()
    ids = token_batch(model.config.vocab_size, batch=8, seq=32)
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model_(model, torch.float32)
        got = model(ids).logits
    cos, same = agreement(ref, got)
    assert cos > 0.99
    assert same > 0.9


def test_bf16_model_quantizes_and_follows_the_bf16_model() -> None:
    model = tiny_model(dtype=torch.bfloat16)
    ids = token_batch(model.config.vocab_size, batch=8, seq=32)
    with torch.no_grad():
        ref = model(ids).logits
        report = quantize_model_(model, torch.bfloat16)
        got = model(ids).logits
    q = cast(DecoderLayer, model.model.layers[0]).attention.query_key_value
    assert isinstance(q, Int8Linear) and q.scale.dtype == torch.bfloat16 and q.weight_q.dtype == torch.int8
    assert got.dtype == torch.bfloat16
    assert report.bytes_before == dense_weight_bytes(model.config, torch.bfloat16)
    assert report.bytes_after == int8_weight_bytes(model.config, torch.bfloat16)
    cos, same = agreement(ref, got)
    assert cos > 0.99 and same > 0.9


@pytest.mark.skipif(not grouped_mm_available(), reason="torch._grouped_mm not in this torch")
def test_grouped_dispatch_reads_the_dequantised_expert_weights() -> None:
    model = tiny_model()
    ids = token_batch(model.config.vocab_size)
    quantize_model_(model, torch.float32)
    with torch.no_grad():
        sorted_logits = model(ids).logits
        model.set_dispatch("grouped")
        grouped_logits = model(ids).logits
    torch.testing.assert_close(grouped_logits, sorted_logits, rtol=1e-4, atol=1e-5)


# --- Int8Linear ---------------------------------------------------------------------------------------------


def seeded_linear(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0
) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


def test_chunking_changes_nothing_and_leaves_the_source_alone() -> None:
    linear = seeded_linear(37, 20, bias=True)
    with torch.no_grad():
        linear.weight[5].zero_()  # an all-zero row must not divide by zero
    before = linear.weight.detach().clone()
    whole = Int8Linear.from_linear(linear, torch.float32)
    chunked = Int8Linear.from_linear(linear, torch.float32, rows_per_chunk=3)
    assert torch.equal(linear.weight, before)  # float32 source: the chunk is a copy, not a view
    assert torch.equal(whole.weight_q, chunked.weight_q) and torch.equal(whole.scale, chunked.scale)
    assert torch.equal(whole.weight_q[5], torch.zeros(20, dtype=torch.int8)) and torch.isfinite(whole.scale).all()
    assert whole.bias is not None and torch.equal(whole.bias, linear.bias)
    with pytest.raises(ValueError, match="rows_per_chunk must be positive, got 0"):
        Int8Linear.from_linear(linear, torch.float32, rows_per_chunk=0)
    with pytest.raises(ValueError, match="must be floating point, got torch.int8"):
        Int8Linear(4, 4, False, torch.int8)


def test_forward_matches_the_dequantised_matmul() -> None:
    linear = seeded_linear(24, 40, bias=True)
    q = Int8Linear.from_linear(linear, torch.float32)
    x = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(q(x), F.linear(x, q.weight, q.bias), rtol=1e-5, atol=1e-6)
        assert q(x).shape == (2, 5, 24)


def test_float16_input_is_scaled_before_the_matmul() -> None:
    # Wide rows of large activations: q * x sums past float16's 65504 unless the scale is applied first.
    linear = seeded_linear(8, 4096, bias=False)
    q = Int8Linear.from_linear(linear, torch.float16)
    x = torch.full((4, 4096), 8.0, dtype=torch.float16)
    x[:, 1::2] = -8.0
    x = x * torch.sign(q.weight_q.to(torch.float16)[0])  # row 0 adds up every |q|
    with torch.no_grad():
        y = q(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), F.linear(x.float(), q.weight.float()), rtol=1e-2, atol=1e-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_rest_of_the_batch(dtype: torch.dtype) -> None:
    # Batches of >= 4 rows: the CPU matmul gives each row the same bits at any such M.
    q = Int8Linear.from_linear(seeded_linear(48, 64, bias=True, dtype=dtype), dtype)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    others = torch.randn(8, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        full = q(x)
        for i in range(8):
            sub = torch.cat([others[:2], x[i : i + 1], others[2:3]])  # row i at position 2 of a batch of 4
            assert torch.equal(q(sub)[2], full[i]), i
        assert torch.equal(q(x), full)  # and the same call twice gives the same bits


def test_state_dict_round_trip() -> None:
    model = tiny_model()
    quantize_model_(model, torch.float32)
    fresh = tiny_model(dtype=torch.float32)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    quantize_model_(fresh, torch.float32)
    fresh.load_state_dict(model.state_dict())
    ids = token_batch(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert "model.layers.0.attention.query_key_value.weight_q" in model.state_dict()


# --- size estimates -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"use_qkv_bias": True, "use_bias": True, "tie_word_embeddings": True},
        {"first_k_dense_replace": 0, "num_shared_experts": 0},
        {"first_k_dense_replace": 2, "num_shared_experts": 2},
    ],
    ids=["tiny", "biases-tied", "all-moe-no-shared", "all-dense"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_estimates_match_the_real_tiny_model(overrides: dict[str, Any], dtype: torch.dtype) -> None:
    config = dataclasses.replace(preset("tiny"), **overrides)
    model = tiny_model(config, dtype)
    assert model_bytes(model) == dense_weight_bytes(config, dtype) == config.num_parameters() * dtype.itemsize
    quantize_model_(model, dtype)
    estimate, actual = int8_weight_bytes(config, dtype), model_bytes(model)
    assert abs(estimate - actual) <= 0.01 * actual
    assert estimate == actual  # the estimate is a layout, not a fit: it should be exact


def test_ling_lite_fits_24_gib_once_quantized() -> None:
    cfg = preset("ling-lite")  # shapes only; never built
    assert dense_weight_bytes(cfg, torch.bfloat16) == pytest.approx(33.6e9, rel=0.01)
    assert cfg.num_parameters() == pytest.approx(16.8e9, rel=0.01)
    assert int8_weight_bytes(cfg, torch.float32) < 20 * 2**30
    assert int8_weight_bytes(cfg, torch.bfloat16) == pytest.approx(17.34e9, rel=0.01)
