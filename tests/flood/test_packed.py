"""Inference layouts: packed oneDNN linears, input-major experts and fused MLPs compute the model's function,
row by row independently of the batch and of the thread count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lingctl.flood.engine import packed
from lingctl.flood.engine.experts import StackedExperts, stack_of
from lingctl.flood.engine.forward import StageModel
from lingctl.flood.engine.packed import PackedLinear
from lingctl.flood.engine.segment_cache import KVPool
from lingctl.flood.weights.quantize import Int8Linear
from lingctl.model.moe import SparseMoeBlock
from tests.flood.conftest import tiny_model


def _linear(out_f: int, in_f: int, dtype: torch.dtype = torch.float32, bias: bool = False) -> nn.Linear:
    g = torch.Generator().manual_seed(out_f * 31 + in_f)
    lin = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    return lin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(512, 256), (1000, 64), (96, 2048)])
def test_a_row_gets_the_same_bits_whatever_shares_its_product(shape: tuple[int, int], dtype: torch.dtype) -> None:
    lin = _linear(*shape, dtype=dtype, bias=shape[0] == 1000)
    p = PackedLinear.of(lin)
    assert p is not None
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        whole = p(x)
        assert torch.allclose(
            whole.float(),
            lin(x).float(),
            rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
            atol=1e-2 if dtype == torch.bfloat16 else 1e-4,
        )
        for start in (0, 5, 33, 66):
            assert torch.equal(p(x[start : start + 4]), whole[start : start + 4])
        for rows in (4, 9, 64):
            assert torch.equal(p(x[:rows]), whole[:rows])


def test_thread_count_does_not_change_the_bits():
    lin = _linear(2048, 256)
    p = PackedLinear.of(lin)
    assert p is not None
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = p(x)
        torch.set_num_threads(1)
        one = p(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_only_float_cpu_linears_are_packed():
    assert PackedLinear.of(Int8Linear.from_linear(_linear(8, 8), torch.float32)) is None
    with torch.device("meta"):
        meta = nn.Linear(8, 8)
    assert PackedLinear.of(meta) is None
    assert PackedLinear.of(nn.Embedding(4, 4)) is None


def test_packing_is_reported_honestly():
    p = PackedLinear(_linear(64, 32).weight)
    assert p.packed == packed.available()
    assert p.nbytes == (64 * 32 * 4 if p.packed else 0)


def test_a_stage_keeps_the_model_its_names_values_and_function():
    model = tiny_model()
    model.eval()
    model.normalize_head_()
    ids = torch.tensor([[5, 9, 200, 7, 7, 31]])
    with torch.no_grad():
        before_logits = model(ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    c = model.config
    StageModel(
        model, KVPool(c.num_hidden_layers, 64, c.num_key_value_heads, c.head_dim, torch.float32), 0, c.num_hidden_layers
    )
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():  # a weight read row-major may round differently in the last bit
        assert torch.allclose(model(ids).logits, before_logits, rtol=0, atol=1e-5)
    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    stack = stack_of(block)
    assert stack is not None
    # the experts' weights are views of the input-major stack: one copy of each weight
    w = block.expert(3).up_proj.weight
    assert w.untyped_storage().data_ptr() == stack.gate_up_EXD.untyped_storage().data_ptr()
    assert stack.gate_up_EXD.transpose(1, 2).is_contiguous()


def test_input_major_experts_give_the_bits_of_the_loop_for_groups_of_four_or_more():
    model = tiny_model()
    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    experts = StackedExperts(block, min_rows=4)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, model.config.hidden_size, generator=g)
    route = block.gate(x)
    with torch.no_grad():
        together = experts(x, route.topk_idx_TK, route.topk_weight_TK)
        for i in (0, 17, 39):
            alone = experts(x[i : i + 1], route.topk_idx_TK[i : i + 1], route.topk_weight_TK[i : i + 1])
            assert torch.equal(alone[0], together[i])
        # the model's own dispatch on the same weights (now views of the stack) agrees to rounding
        ref, _ = block(x.unsqueeze(0))
        shared = block.shared_experts(x) if block.shared_experts is not None else 0
        assert torch.allclose(together + shared, ref[0], atol=1e-5)


def test_fused_mlp_matches_the_module():
    from lingctl.flood.engine.forward import FusedMLP
    from lingctl.model.layers import MLP

    mlp = MLP(64, 96)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(9, 64, generator=g)
    with torch.no_grad():
        ref = mlp(x)
        fused = FusedMLP(mlp)
        assert torch.allclose(fused(x), ref, atol=1e-5)
        assert torch.equal(mlp(x), ref)  # the module's weights are views of the fused ones, unchanged
        assert torch.equal(fused(x[2:6]), fused(x)[2:6])
