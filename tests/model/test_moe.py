from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn

from lingctl.model.config import LingConfig
from lingctl.model.layers import MLP
from lingctl.model.ling import LingForCausalLM
from lingctl.model.moe import (
    Dispatch,
    Router,
    SparseMoeBlock,
    dispatch_grouped,
    dispatch_naive,
    dispatch_sorted,
    grouped_mm_available,
)

needs_grouped_mm = pytest.mark.skipif(not grouped_mm_available(), reason="torch._grouped_mm not in this torch")


def moe_config(**overrides: Any) -> LingConfig:
    fields: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=24,
        num_experts=8,
        num_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        pad_token_id=0,
        eos_token_id=0,
        norm_head=False,
    )
    fields.update(overrides)
    config = LingConfig(**fields)
    config.validate()
    return config


def seeded_router(config: LingConfig, seed: int = 0) -> Router:
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed))
    return router


def seeded_block(config: LingConfig, seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.5)  # the router weight starts uninitialised (torch.empty)
    return block


# --- router -----------------------------------------------------------------------------------------------


def test_router_softmax_topk_and_renormalisation() -> None:
    config = moe_config(num_experts=6, num_experts_per_tok=3)
    router = seeded_router(config)
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = router(x)
    logits = x @ router.weight.T
    probs = logits.softmax(dim=-1)
    assert out.logits_TE.dtype == torch.float32 and out.probs_TE.dtype == torch.float32
    torch.testing.assert_close(out.logits_TE, logits)
    torch.testing.assert_close(out.probs_TE, probs)
    top_probs, top_idx = probs.topk(3, dim=-1)
    assert torch.equal(out.topk_idx_TK.sort(dim=-1).values, top_idx.sort(dim=-1).values)
    # Each weight belongs to its own index (topk is unsorted, so pair them up before comparing).
    picked = probs.gather(1, out.topk_idx_TK)
    torch.testing.assert_close(out.topk_weight_TK, picked / picked.sum(-1, keepdim=True))
    torch.testing.assert_close(out.topk_weight_TK.sum(-1), torch.ones(10))
    assert (top_probs.sum(-1) < 0.999).all()  # so the renormalisation above was not a no-op


def test_router_without_norm_topk_prob_keeps_raw_probabilities() -> None:
    router = seeded_router(moe_config(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False))
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = router(x)
    torch.testing.assert_close(out.topk_weight_TK, out.probs_TE.gather(1, out.topk_idx_TK))


def test_router_top1_weight_is_the_raw_probability() -> None:
    # Ling renormalises only when k > 1: with k=1 the weight is the probability itself, not 1.
    router = seeded_router(moe_config(num_experts=6, num_experts_per_tok=1, norm_topk_prob=True))
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = router(x)
    probs = (x @ router.weight.T).softmax(-1)
    assert out.topk_idx_TK.shape == (10, 1)
    assert torch.equal(out.topk_idx_TK[:, 0], probs.argmax(-1))
    torch.testing.assert_close(out.topk_weight_TK[:, 0], probs.max(-1).values)
    assert (out.topk_weight_TK < 0.999).all()


# --- dispatch ---------------------------------------------------------------------------------------------

Dispatcher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, nn.ModuleList], torch.Tensor]


def run_dispatch(
    fn: Dispatcher,
    x: torch.Tensor,
    idx: torch.Tensor,
    weight: torch.Tensor,
    experts: nn.ModuleList,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Forward and backward of one dispatch; expert grads as one flat tensor (no grad = zeros)."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = fn(x, idx, weight, experts)
    y.backward(grad_out)
    expert_grads = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in experts.parameters()]
    )
    assert x.grad is not None and weight.grad is not None
    return y.detach(), x.grad, weight.grad, expert_grads


def prefixed(name: str) -> Callable[[str], str]:
    """An ``assert_close`` message that names what is compared."""
    return lambda m: f"{name}: {m}"


WideMoe = tuple[nn.ModuleList, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def wide_moe() -> WideMoe:
    """Ling-lite's 64 experts top-6 over 50 tokens, so expert loads are uneven and some are empty."""
    config = moe_config(hidden_size=32, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=16)
    torch.manual_seed(0)
    experts = nn.ModuleList(MLP(32, 16) for _ in range(64))
    x = torch.randn(50, 32)
    with torch.no_grad():
        route = seeded_router(config)(x)
    grad_out = torch.randn(50, 32)
    return experts, x, route.topk_idx_TK, route.topk_weight_TK, grad_out


def test_sorted_dispatch_equals_naive(wide_moe: WideMoe) -> None:
    experts, x, idx, weight, grad_out = wide_moe
    naive = run_dispatch(dispatch_naive, x, idx, weight, experts, grad_out)
    sorted_ = run_dispatch(dispatch_sorted, x, idx, weight, experts, grad_out)
    assert naive[0].abs().max() > 0.1
    assert (torch.bincount(idx.reshape(-1), minlength=64) == 0).any()  # the empty-expert path runs too
    for name, a, b in zip(("output", "grad x", "grad weight", "grad experts"), sorted_, naive):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=prefixed(name))


@needs_grouped_mm
def test_grouped_dispatch_matches_naive(wide_moe: WideMoe) -> None:
    experts, x, idx, weight, grad_out = wide_moe
    naive = run_dispatch(dispatch_naive, x, idx, weight, experts, grad_out)
    grouped = run_dispatch(dispatch_grouped, x, idx, weight, experts, grad_out)
    for name, a, b in zip(("output", "grad x", "grad weight", "grad experts"), grouped, naive):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=prefixed(name))


@needs_grouped_mm
def test_dispatches_under_bf16_autocast(wide_moe: WideMoe) -> None:
    experts, x, idx, weight, _ = wide_moe
    with torch.no_grad():
        reference = dispatch_naive(x, idx, weight, experts)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = {
                fn.__name__: fn(x, idx, weight, experts) for fn in (dispatch_naive, dispatch_sorted, dispatch_grouped)
            }
    scale = reference.abs().max().item()
    for name, out in outs.items():
        assert out.dtype == torch.float32, name  # the combine is in float32 and returns x's dtype
        # bf16 keeps ~3 significant digits; a wrong expert or weight would be off by O(scale).
        err = (out - reference).abs().max().item()
        assert err < 0.03 * scale, f"{name}: max error {err:.4g} vs output scale {scale:.4g}"


@pytest.mark.parametrize("dispatch", ["naive", "sorted", pytest.param("grouped", marks=needs_grouped_mm)])
def test_experts_without_tokens(dispatch: Dispatch) -> None:
    config = moe_config(num_experts=8, num_experts_per_tok=2)
    block = seeded_block(config, seed=1)
    assert block.shared_experts is not None
    block.dispatch = dispatch
    with torch.no_grad():
        # Feature 0 is a constant 1 and only experts 2 and 5 read it: they win for every token.
        block.gate.weight.zero_()
        block.gate.weight[2, 0] = 10.0
        block.gate.weight[5, 0] = 10.0
    x = torch.randn(2, 6, 16)
    x[..., 0] = 1.0
    x.requires_grad_()
    y, route = block(x)
    assert set(route.topk_idx_TK.unique().tolist()) == {2, 5}
    with torch.no_grad():
        expected = 0.5 * block.experts[2](x) + 0.5 * block.experts[5](x) + block.shared_experts(x)
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-5)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    grad = block.expert(2).down_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    for e in (0, 1, 3, 4, 6, 7):
        grad = block.expert(e).down_proj.weight.grad
        assert grad is None or torch.count_nonzero(grad) == 0, e


# --- shared expert ----------------------------------------------------------------------------------------


def test_block_is_routed_part_plus_ungated_shared_expert() -> None:
    config = moe_config()
    block = seeded_block(config, seed=2)
    assert block.shared_experts is not None
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y, route = block(x)
        x_TD = x.reshape(10, 16)
        routed = dispatch_naive(x_TD, route.topk_idx_TK, route.topk_weight_TK, block.experts).view(2, 5, 16)
        torch.testing.assert_close(y, routed + block.shared_experts(x), atol=1e-6, rtol=1e-5)
        # With every routed expert silenced the output is the shared expert alone, bit for bit.
        for expert in block.experts:
            cast(MLP, expert).down_proj.weight.zero_()
        y, _ = block(x)
        assert torch.equal(y, block.shared_experts(x))
        assert y.abs().max() > 0


def test_shared_expert_width_is_num_shared_times_expert_width() -> None:
    block = SparseMoeBlock(moe_config(num_shared_experts=2, moe_intermediate_size=12))
    assert block.shared_experts is not None
    assert block.shared_experts.gate_proj.weight.shape == (24, 16)
    assert block.shared_experts.up_proj.weight.shape == (24, 16)
    assert block.shared_experts.down_proj.weight.shape == (16, 24)
    assert SparseMoeBlock(moe_config(num_shared_experts=0)).shared_experts is None


# --- routing warmup ---------------------------------------------------------------------------------------


def warmup_router(alpha: float, seed: int) -> Router:
    router = seeded_router(moe_config(num_experts=8), seed=seed)
    router.warmup_alpha = alpha
    router.noise_generator = torch.Generator().manual_seed(123)
    return router


def logit_stats(router: Router) -> tuple[float, float]:
    """The router's running logit mean and std, which its first training forward sets."""
    assert router.logit_mean is not None and router.logit_std is not None
    return router.logit_mean, router.logit_std


def test_warmup_alpha_zero_ignores_the_learned_direction() -> None:
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(9))
    # With the logit statistics fixed (eval mode, stats set), any weight gives the same routing.
    outs = []
    for seed in (0, 1):
        router = warmup_router(0.0, seed).eval()
        router.logit_mean, router.logit_std = 0.3, 1.7
        with torch.no_grad():
            outs.append(router(x))
    assert torch.equal(outs[0].probs_TE, outs[1].probs_TE)
    assert torch.equal(outs[0].topk_idx_TK, outs[1].topk_idx_TK)
    assert not torch.allclose(outs[0].logits_TE, outs[1].logits_TE)
    assert not torch.allclose(outs[0].probs_TE, outs[0].logits_TE.softmax(-1), atol=1e-3)
    # In training the noise takes the learned logits' mean and std, so only those reach the routing:
    # permuting the experts (rows of W) keeps them and hence the routed probabilities.
    a, b = warmup_router(0.0, 0), warmup_router(0.0, 0)
    with torch.no_grad():
        b.weight.copy_(a.weight[torch.randperm(8, generator=torch.Generator().manual_seed(4))])
        pa, pb = a(x), b(x)
    torch.testing.assert_close(pa.probs_TE, pb.probs_TE, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(pa.logits_TE, pb.logits_TE)


def test_warmup_blend_uses_running_logit_statistics() -> None:
    router = warmup_router(0.5, 0)
    noise = torch.Generator().manual_seed(123)  # the same stream the router draws from
    assert router.logit_mean is None and router.logit_std is None
    for step in range(2):
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(10 + step))
        with torch.no_grad():
            out = router(x)
        learned = x @ router.weight.T
        if step == 0:
            # The first call initialises the statistics from the batch itself.
            assert router.logit_mean == pytest.approx(learned.mean().item(), abs=1e-6)
            assert router.logit_std == pytest.approx(learned.std().item(), rel=1e-5)
            first = logit_stats(router)
        else:
            m = router.stats_momentum
            assert router.logit_mean == pytest.approx(m * first[0] + (1 - m) * learned.mean().item(), abs=1e-6)
        drawn = torch.randn(12, 8, generator=noise)
        mean, std = logit_stats(router)
        routed = 0.5 * learned + 0.5 * (drawn * std + mean)
        torch.testing.assert_close(out.probs_TE, routed.softmax(-1), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out.logits_TE, learned)


def test_warmup_alpha_one_is_plain_routing() -> None:
    router = warmup_router(1.0, 0)
    assert router.noise_generator is not None
    state = router.noise_generator.get_state()
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out = router(x)
    assert torch.equal(out.probs_TE, out.logits_TE.softmax(-1))
    torch.testing.assert_close(out.logits_TE, x @ router.weight.T)
    assert torch.equal(router.noise_generator.get_state(), state)  # no noise drawn
    assert router.logit_mean is None


# --- the whole model --------------------------------------------------------------------------------------


def test_state_dict_names_are_lings() -> None:
    config = moe_config(num_hidden_layers=3, first_k_dense_replace=1, num_experts=4, num_shared_experts=1)
    expected = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(3):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight",
            p + "attention.query_key_value.weight",
            p + "attention.dense.weight",
            p + "post_attention_layernorm.weight",
        }
    expected |= {f"model.layers.0.mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")}
    for i in (1, 2):
        p = f"model.layers.{i}.mlp."
        expected.add(p + "gate.weight")
        expected |= {f"{p}experts.{e}.{proj}_proj.weight" for e in range(4) for proj in ("gate", "up", "down")}
        expected |= {f"{p}shared_experts.{proj}_proj.weight" for proj in ("gate", "up", "down")}
    assert set(LingForCausalLM(config).state_dict()) == expected


def norm_head_model(seed: int = 0) -> LingForCausalLM:
    model = LingForCausalLM(moe_config(norm_head=True, vocab_size=50))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def test_norm_head_normalises_columns_over_the_vocabulary() -> None:
    model = norm_head_model()
    head = model.head_weight()
    assert head.dtype == torch.float32
    assert head.shape == (50, 16)
    torch.testing.assert_close(torch.linalg.vector_norm(head, dim=0), torch.ones(16), atol=1e-5, rtol=0)
    # Rows (one per token) are not unit vectors: the norm is over dim 0, not dim 1.
    assert not torch.allclose(torch.linalg.vector_norm(head, dim=1), torch.ones(50), atol=1e-2)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, _ = model.hidden_states(ids)
        torch.testing.assert_close(model(ids).logits, hidden @ head.T, atol=1e-6, rtol=1e-5)


def test_norm_head_gradient_skips_the_norm() -> None:
    model = norm_head_model()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, _ = model.hidden_states(ids)
    grad_out = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(2))
    model.logits(hidden).backward(grad_out)
    got = model.lm_head.weight.grad
    assert got is not None

    def grad_with(detach_norm: bool) -> torch.Tensor:
        w = model.lm_head.weight.detach().clone().requires_grad_()
        norm = torch.linalg.vector_norm(w.detach() if detach_norm else w, dim=0, keepdim=True) + 1e-7
        (hidden @ (w / norm).T).backward(grad_out)
        assert w.grad is not None
        return w.grad

    torch.testing.assert_close(got, grad_with(detach_norm=True), atol=1e-6, rtol=1e-5)
    # The two gradients differ, so the comparison above tells the two rules apart.
    assert not torch.allclose(got, grad_with(detach_norm=False), atol=1e-4)


def test_normalize_head_bakes_the_norm_in() -> None:
    model = norm_head_model()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        model.normalize_head_()
        after = model(ids).logits
    assert model.config.norm_head is False
    assert torch.equal(before, after)
    torch.testing.assert_close(torch.linalg.vector_norm(model.lm_head.weight, dim=0), torch.ones(16), atol=1e-5, rtol=0)


def test_norm_head_forward_of_a_bf16_model() -> None:
    # Ling's own NormHead keeps the weight's dtype; a bf16 model (e.g. loaded with dtype=bfloat16) must run.
    model = norm_head_model().to(torch.bfloat16)
    ids = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 4, 50)
    assert torch.isfinite(logits.float()).all()


def test_full_forward_shapes_routes_and_causality() -> None:
    config = moe_config(num_hidden_layers=3, first_k_dense_replace=1, vocab_size=40)
    model = LingForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids)
        assert out.logits.shape == (2, 7, 40)
        assert len(out.routes) == 2  # layers 1 and 2 are MoE, layer 0 dense
        for route in out.routes:
            assert route.topk_idx_TK.shape == (14, 2)
            assert route.probs_TE.shape == (14, 8)
        # Changing the last token changes only the last position's logits.
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 40
        other = model(changed).logits
        torch.testing.assert_close(other[:, :-1], out.logits[:, :-1], atol=1e-6, rtol=1e-5)
        assert not torch.allclose(other[:, -1], out.logits[:, -1])
        # The dispatch strategy does not change the function.
        model.set_dispatch("naive")
        torch.testing.assert_close(model(ids).logits, out.logits, atol=1e-6, rtol=1e-5)
