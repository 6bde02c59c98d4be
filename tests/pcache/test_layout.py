"""What each rank holds: tensors from presets, directories and lists; tp/pp/ep cuts; optimizer state."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from lingctl.core.errors import UsageError
from lingctl.model.checkpoint import save_checkpoint
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset
from lingctl.model.safetensors_io import write_safetensors
from lingctl.pcache.layout import Parallelism, write_items
from lingctl.pcache.model_tensors import _skip_init_mode, ling_tensors, load_model


def held(items, name: str) -> tuple[int, ...]:
    return items.holders(items.names.index(name))


@pytest.mark.parametrize(
    "config",
    [
        preset("tiny"),
        preset("small"),
        dataclasses.replace(
            preset("tiny"),
            num_hidden_layers=5,
            first_k_dense_replace=2,
            tie_word_embeddings=True,
            use_qkv_bias=True,
            use_bias=True,
        ),
        dataclasses.replace(preset("tiny"), num_hidden_layers=3, first_k_dense_replace=3),
    ],
)
def test_preset_tensors_are_the_meta_models_parameters(config):
    with torch.device("meta"), _skip_init_mode():  # the full model, every layer built
        model = LingForCausalLM(dataclasses.replace(config))
    want = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [(t.name, t.shape) for t in ling_tensors(config)] == want


def test_tp_pp_ep_cuts_put_shards_on_their_ranks():
    # small: 4 layers, 8 heads / 2 KV heads of 32, hidden 256, 16 experts. World 16: r = tp + 2ep + 4edp + 8pp.
    items = write_items(load_model("small"), Parallelism(tp=2, pp=2, dp=4, ep=2), optimizer="none")
    qkv = "model.layers.0.attention.query_key_value.weight"  # (8 + 2*2) * 32 = 384 rows, column-parallel
    assert held(items, f"{qkv}[0:192]") == (0, 2, 4, 6)
    assert held(items, f"{qkv}[192:384]") == (1, 3, 5, 7)
    dense = "model.layers.3.attention.dense.weight"  # row-parallel: in features (dim 1) split, stage 1
    assert held(items, f"{dense}[:, 128:256]") == (9, 11, 13, 15)
    assert items.shapes[items.names.index(f"{dense}[:, 128:256]")] == (256, 128)
    assert held(items, "model.word_embeddings.weight[0:4096]") == (0, 2, 4, 6)
    assert held(items, "lm_head.weight[4096:8192]") == (9, 11, 13, 15)
    assert held(items, "model.norm.weight") == tuple(range(8, 16))
    assert held(items, "model.layers.1.input_layernorm.weight") == tuple(range(8))
    assert held(items, "model.layers.2.mlp.gate.weight") == tuple(range(8, 16))  # the router: replicated
    # Experts are whole on every tp rank of their ep index: 9 * 2 // 16 = ep 1.
    assert held(items, "model.layers.1.mlp.experts.9.down_proj.weight") == (2, 3, 6, 7)
    assert held(items, "model.layers.1.mlp.experts.7.up_proj.weight") == (0, 1, 4, 5)
    assert held(items, "model.layers.1.mlp.shared_experts.down_proj.weight[:, 0:128]") == (0, 2, 4, 6)
    # Every byte of the model is held somewhere, exactly once per item.
    assert int(items.sizes.sum()) == load_model("small").num_parameters * 4


def test_order_decides_which_ranks_form_each_group():
    items = write_items(load_model("small"), Parallelism(tp=2, pp=2, dp=4, ep=2, order="tp-dp-ep-pp"), optimizer="none")
    # r = tp + 2edp + 4ep + 8pp: ep 1 of stage 0 is ranks 4..7.
    assert held(items, "model.layers.1.mlp.experts.9.down_proj.weight") == (4, 5, 6, 7)
    pp_first = write_items(
        load_model("small"), Parallelism(tp=2, pp=2, dp=4, ep=2, order="pp-tp-ep-dp"), optimizer="none"
    )
    assert held(pp_first, "model.norm.weight") == tuple(range(1, 16, 2))


@pytest.mark.parametrize(
    "optimizer,dtype,per_param",
    [
        ("adamw", "bfloat16", 2 + 4 * 3),
        ("adamw", None, 4 + 4 * 2),
        ("sgd", "bfloat16", 2 + 4 * 2),
        ("sgd", None, 4 + 4),
        ("none", "float16", 2),
    ],
)
def test_optimizer_state_bytes(optimizer, dtype, per_param):
    model = load_model("tiny")  # float32 preset
    items = write_items(model, Parallelism(dp=2), optimizer=optimizer, dtype=dtype)
    assert int(items.sizes.sum()) == model.num_parameters * per_param
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    if optimizer == "adamw":
        assert f"optim.state.{name}.exp_avg_sq" in items.names
        assert (f"optim.state.{name}.master" in items.names) == (dtype is not None)
    # State-dict order: every parameter, then the optimizer states.
    kinds = items.kinds.tolist()
    assert kinds == sorted(kinds, key=lambda k: k != 0)


def test_sharded_optimizer_items_are_rank_unique_without_tp():
    model = load_model("small")
    p = Parallelism(dp=4, ep=2, shard_optimizer=True)
    items = write_items(model, p, optimizer="adamw", dtype="bfloat16")
    plain = write_items(model, dataclasses.replace(p, shard_optimizer=False), optimizer="adamw", dtype="bfloat16")
    assert int(items.sizes.sum()) == int(plain.sizes.sum())
    for i in range(len(items)):
        if items.kinds[i] != 0:
            assert len(items.holders(i)) == 1, items.names[i]
    # ZeRO pieces cut dim 0 over the dp replicas: dp = 4 for dense tensors, dp / ep = 2 for experts.
    assert held(items, "optim.state.model.layers.0.attention.dense.weight.exp_avg[64:128]") == (1,)
    assert held(items, "optim.state.model.layers.0.mlp.experts.15.gate_proj.weight.exp_avg[128:256]") == (3,)


def test_sharded_optimizer_with_tp_keeps_tp_replicas_of_replicated_tensors():
    items = write_items(load_model("small"), Parallelism(tp=2, dp=2, shard_optimizer=True), optimizer="sgd")
    assert held(items, "optim.state.model.layers.0.attention.dense.weight.momentum_buffer[128:256, 128:256]") == (3,)
    assert held(items, "optim.state.model.norm.weight.momentum_buffer[0:128]") == (0, 1)


@pytest.mark.parametrize(
    "p,words",
    [
        (Parallelism(dp=6, ep=4), ["ep 4", "dp 6"]),
        (Parallelism(dp=6, ep=3), ["ep 3", "16 experts"]),
        (Parallelism(pp=5), ["pp 5", "4 layers"]),
        (Parallelism(tp=3), ["tp 3", "8 attention heads"]),
        (Parallelism(order="tp-dp-pp-xx"), ["tp-dp-pp-xx"]),
    ],
)
def test_bad_parallelism_names_the_values(p, words):
    with pytest.raises(UsageError) as err:
        write_items(load_model("small"), p)
    for word in words:
        assert word in str(err.value)


def test_bad_models(tmp_path):
    with pytest.raises(UsageError, match="unknown model preset 'ling-max'"):
        load_model("ling-max")
    with pytest.raises(UsageError, match="no such directory"):
        load_model(str(tmp_path / "gone"))
    with pytest.raises(UsageError, match="model.safetensors"):
        load_model(str(tmp_path))
    listed = tmp_path / "t.json"
    listed.write_text(json.dumps([{"name": "w", "shape": [2, -1]}]))
    with pytest.raises(UsageError, match=r"w: shape .*-1"):
        load_model(str(listed))
    listed.write_text(json.dumps([{"name": "w", "shape": [2], "dtype": "float13"}]))
    with pytest.raises(UsageError, match="float13"):
        load_model(str(listed))
    with pytest.raises(UsageError, match="optimizer 'lion'"):
        write_items(load_model("tiny"), Parallelism(), optimizer="lion")


def test_tensor_list(tmp_path):
    listed = tmp_path / "tensors.json"
    listed.write_text(
        json.dumps(
            [
                {"name": "embed_tokens.weight", "shape": [100, 8]},
                {"name": "layers.0.mlp.experts.0.w1.weight", "shape": [16, 8], "dtype": "F32"},
                {"name": "layers.1.mlp.experts.3.w1.weight", "shape": [16, 8]},
                {"name": "layers.1.self_attn.o_proj.weight", "shape": [8, 8]},
                {"name": "head.weight", "shape": [100, 8]},
            ]
        )
    )
    model = load_model(str(listed))
    assert (model.num_layers, model.num_experts, model.num_heads) == (2, 4, None)
    assert model.tensors[1].dtype == "float32" and model.tensors[0].dtype == "bfloat16"
    items = write_items(model, Parallelism(tp=2, pp=2, dp=2, ep=2), optimizer="none")
    assert held(items, "embed_tokens.weight[50:100]") == (1, 3)
    assert held(items, "layers.1.self_attn.o_proj.weight[:, 0:4]") == (4, 6)
    assert held(items, "layers.1.mlp.experts.3.w1.weight") == (6, 7)  # ep 1 of stage 1, every tp rank
    assert held(items, "head.weight") == (4, 5, 6, 7)  # unknown names outside layers: last stage, replicated


def test_checkpoint_directories_read_headers_in_model_order(tmp_path):
    config = preset("tiny")
    torch.manual_seed(0)
    save_checkpoint(LingForCausalLM(dataclasses.replace(config)), tmp_path / "single", dtype=torch.bfloat16)
    single = load_model(str(tmp_path / "single"))
    want = [(t.name, t.shape) for t in ling_tensors(config)]
    assert [(t.name, t.shape) for t in single.tensors] == want
    assert {t.dtype for t in single.tensors} == {"bfloat16"}
    assert (single.num_layers, single.num_experts, single.num_heads) == (2, 8, 4)
    # Sharded: an index and two files, tensors split between them.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    state = {name: torch.zeros(shape, dtype=torch.float16) for name, shape in want}
    names = sorted(state)
    weight_map = {}
    for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{part:05d}.safetensors"
        with open(sharded / file, "wb") as f:
            write_safetensors(f, {n: state[n] for n in chunk})
        weight_map.update({n: file for n in chunk})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(str(sharded))
    assert [(t.name, t.shape, t.dtype) for t in model.tensors] == [(n, s, "float16") for n, s in want]
    assert math.prod(model.tensors[0].shape) * 2 == write_items(model, Parallelism(), "none").sizes[0]
