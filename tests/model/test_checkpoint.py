from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.model.checkpoint import load_checkpoint, model_state, save_checkpoint
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM

TOKENIZER_JSON = '{"version": "1.0", "model": {"type": "BPE"}}'


def tiny_model(seed: int = 0, **overrides: object) -> LingForCausalLM:
    fields: dict[str, object] = dict(
        vocab_size=61,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=24,
        num_experts=4,
        num_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        first_k_dense_replace=1,
        pad_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    fields.update(overrides)
    model = LingForCausalLM(LingConfig(**fields))  # type: ignore[arg-type]
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


IDS = torch.tensor([[3, 14, 15, 9, 26, 5], [35, 8, 9, 7, 9, 3]])


def logits(model: LingForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def write_checkpoint(directory: Path, config: LingConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint written with the reference safetensors package, not our writer."""
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    config.save(directory / "config.json")
    return directory


# --- save and load ----------------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    model = tiny_model()
    save_checkpoint(model, tmp_path, tokenizer_json=TOKENIZER_JSON)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "tokenizer.json").read_text() == TOKENIZER_JSON
    # Other tools (transformers, vLLM) refuse a file without this metadata.
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # The reference reader accepts our writer's file and sees the same tensors.
    assert_same_tensors(safetensors.torch.load_file(str(tmp_path / "model.safetensors")), model.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert config["model_type"] == "bailing_moe"
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1 and generation["pad_token_id"] == 0

    loaded = load_checkpoint(tmp_path)
    assert loaded.config == model.config
    assert_same_tensors(loaded.state_dict(), model.state_dict())
    assert torch.equal(logits(loaded), logits(model))


def test_save_in_bf16_and_load_as_float32(tmp_path: Path) -> None:
    model = tiny_model()
    save_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    stored = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {p.dtype for p in load_checkpoint(tmp_path).parameters()} == {torch.bfloat16}
    loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16).float()), name


def test_tied_embeddings_are_stored_once(tmp_path: Path) -> None:
    model = tiny_model(tie_word_embeddings=True)
    save_checkpoint(model, tmp_path)
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names
    assert "model.word_embeddings.weight" in names
    loaded = load_checkpoint(tmp_path)
    # One parameter, not two equal copies: training must update both uses together.
    assert loaded.lm_head.weight is loaded.model.word_embeddings.weight
    assert torch.equal(logits(loaded), logits(model))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    model = tiny_model(seed=3)
    state = model_state(model)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        safetensors.torch.save_file(
            {n: state[n].contiguous() for n in shard_names}, str(tmp_path / shard), metadata={"format": "pt"}
        )
        weight_map.update({n: shard for n in shard_names})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    model.config.save(tmp_path / "config.json")
    loaded = load_checkpoint(tmp_path)
    assert_same_tensors(loaded.state_dict(), model.state_dict())
    assert torch.equal(logits(loaded), logits(model))


# --- errors -----------------------------------------------------------------------------------------------


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    model = tiny_model()
    state = model_state(model)
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    write_checkpoint(tmp_path, model.config, state)
    with pytest.raises(LingctlError, match="lacks") as info:
        load_checkpoint(tmp_path)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in str(info.value)


def test_extra_tensor_is_named(tmp_path: Path) -> None:
    model = tiny_model()
    state = model_state(model)
    state["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(12, 16)  # layer 0 is dense
    write_checkpoint(tmp_path, model.config, state)
    with pytest.raises(LingctlError, match="does not use") as info:
        load_checkpoint(tmp_path)
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in str(info.value)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    model = tiny_model()
    state = model_state(model)
    state["model.layers.1.attention.dense.weight"] = torch.zeros(16, 40)
    write_checkpoint(tmp_path, model.config, state)
    with pytest.raises(LingctlError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "model.layers.1.attention.dense.weight" in message
    assert "(16, 40)" in message and "(16, 32)" in message


def test_directory_without_weights(tmp_path: Path) -> None:
    tiny_model().config.save(tmp_path / "config.json")
    with pytest.raises(NotFoundError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


# --- memory -----------------------------------------------------------------------------------------------


def build_big_and_small(root: Path) -> None:
    """Built in this process: only the measuring process must be fresh."""
    config = LingConfig(
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=192,
        pad_token_id=0,
        eos_token_id=0,
    )
    with torch.device("meta"):
        model = LingForCausalLM(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)  # any finite values: random init of 30M parameters would only cost time
    save_checkpoint(model, root / "big")
    del model
    small = LingForCausalLM(
        LingConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=8,
            pad_token_id=0,
            eos_token_id=0,
        )
    )
    save_checkpoint(small, root / "small")


MEASURE = """
import gc, json, sys
import psutil, torch
from lingctl.model.checkpoint import load_checkpoint
proc = psutil.Process()
# The first load in a process pages in library code (~80 MB of torch) whatever the checkpoint's size;
# a small checkpoint pays that first so the measurement sees only what the weights cost.
load_checkpoint(sys.argv[1] + "/small")
gc.collect()
before = proc.memory_info().rss
model = load_checkpoint(sys.argv[1] + "/big")
loaded = proc.memory_info().rss
# Reading every weight pages the file in: proves the measurement would see a copy if there were one.
total = sum(float(p.sum()) for p in model.parameters())
touched = proc.memory_info().rss
print(json.dumps({"before": before, "loaded": loaded, "touched": touched, "total": total}))
"""


@pytest.mark.slow
def test_load_maps_weights_instead_of_copying(tmp_path: Path) -> None:
    build_big_and_small(tmp_path)
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    assert size > 100e6
    # A fresh process, so nothing of the build is in its memory.
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    numbers = json.loads(result.stdout)
    growth = numbers["loaded"] - numbers["before"]
    report = (
        f"file {size / 1e6:.1f} MB, RSS before load {numbers['before'] / 1e6:.1f} MB, after load "
        f"{numbers['loaded'] / 1e6:.1f} MB (+{growth / 1e6:.1f} MB), after reading every weight "
        f"{numbers['touched'] / 1e6:.1f} MB"
    )
    assert growth < size / 2, report
    assert numbers["touched"] - numbers["before"] > size / 2, report
