"""A lingctl checkpoint as the Hugging Face ecosystem reads it: transformers' tokenizer and config loaders,
the safetensors package, and the checklist of what vLLM's ``bailing_moe`` loader takes from a directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lingctl.model.checkpoint import load_checkpoint, model_state, save_checkpoint
from lingctl.model.checkpoint_files import WEIGHTS, WEIGHTS_INDEX
from lingctl.model.hf_files import LING_CHAT_TEMPLATE, LING_CODE_REPO, SPECIAL_TOKENS, plan_shards, tokenizer_files
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset
from lingctl.model.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Who are you?"},
]


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    text = [f"the quick brown fox {i} jumps over the lazy dog.\n" * 2 for i in range(100)]
    return train_tokenizer(text, 320).to_str()


def _model(vocab: int, *, eos: int = 0) -> LingForCausalLM:
    cfg = preset("tiny")
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id = vocab, eos, eos
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> tuple[Path, LingForCausalLM]:
    """A checkpoint written with shards of at most 64 KB (the tiny model is ~0.3 MB)."""
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    from tokenizers import Tokenizer

    model = _model(Tokenizer.from_str(tokenizer_json).get_vocab_size())
    save_checkpoint(model, path, tokenizer_json=tokenizer_json, max_shard_size="64KB")
    return path, model


def test_side_files_are_the_hub_layout(sharded: tuple[Path, LingForCausalLM]) -> None:
    path, model = sharded
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "bailing_moe" and config["architectures"] == ["BailingMoeForCausalLM"]
    # lingctl's own code beside the weights, named in the plain module.Class form.
    assert config["auto_map"] == {
        "AutoConfig": "configuration_bailing_moe.BailingMoeConfig",
        "AutoModel": "modeling_bailing_moe.BailingMoeModel",
        "AutoModelForCausalLM": "modeling_bailing_moe.BailingMoeForCausalLM",
    }
    assert {p.name for p in path.glob("*.py")} == {"configuration_bailing_moe.py", "modeling_bailing_moe.py"}
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == model.config.eos_token_id == generation["pad_token_id"]
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["eos_token"] == tok_config["pad_token"] == "<|endoftext|>"
    assert tok_config["bos_token"] == "<|startoftext|>"
    assert tok_config["chat_template"] == LING_CHAT_TEMPLATE
    assert [d["content"] for d in tok_config["added_tokens_decoder"].values()] == list(SPECIAL_TOKENS)
    special = json.loads((path / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    # The index comes with shards; no single-file weights beside them that a loader could prefer.
    assert not (path / WEIGHTS).exists()


def test_shards_follow_max_shard_size_and_read_back(sharded: tuple[Path, LingForCausalLM]) -> None:
    from safetensors import safe_open

    path, model = sharded
    index = json.loads((path / WEIGHTS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    state = model_state(model)
    assert set(index["weight_map"]) == set(state)
    total = 0
    seen: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            size = 0
            for name in f.keys():
                seen[name] = f.get_tensor(name)
                size += seen[name].numel() * seen[name].element_size()
            # A shard over the limit holds one tensor that is larger than the limit on its own.
            assert size <= 64_000 or len(list(f.keys())) == 1
            total += size
    assert index["metadata"]["total_size"] == total
    for name, tensor in state.items():
        assert seen[name].dtype == tensor.dtype and seen[name].shape == tensor.shape
        assert torch.equal(seen[name], tensor), name
    loaded = load_checkpoint(path)
    for name, tensor in model_state(loaded).items():
        assert torch.equal(tensor, state[name]), name


def test_plan_shards_keeps_order_and_never_splits_a_tensor() -> None:
    sizes = [("a", 40), ("b", 40), ("c", 100), ("d", 10), ("e", 10)]
    assert plan_shards(sizes, 80) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(sizes, 10**9) == [["a", "b", "c", "d", "e"]]


def test_tokenizer_config_of_a_given_tokenizer_is_kept(tokenizer_json: str) -> None:
    """A tokenizer_config.json that came with the tokenizer (a Hub model's) keeps its template and tokens;
    only what it lacks is filled in."""
    base = {
        "chat_template": "{{ messages[0]['content'] }}",
        "eos_token": {"content": "<|endoftext|>"},
        "tokenizer_class": "LlamaTokenizerFast",
        "custom_field": 1,
    }
    files = tokenizer_files(tokenizer_json, model_max_length=4096, base=base)
    config = files["tokenizer_config.json"]
    assert config["chat_template"] == base["chat_template"] and config["custom_field"] == 1
    assert config["tokenizer_class"] == "LlamaTokenizerFast"
    assert config["eos_token"] == {"content": "<|endoftext|>"} and config["pad_token"] == "<|endoftext|>"
    assert files["special_tokens_map.json"]["pad_token"] == "<|endoftext|>"


def test_transformers_tokenizer_loads_eos_pad_and_ling_chat(sharded: tuple[Path, LingForCausalLM]) -> None:
    transformers = pytest.importorskip("transformers")
    path, _ = sharded
    # trust_remote_code=False: the tokenizer needs no code, and transformers must not ask for it.
    tok = transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok.chat_template == LING_CHAT_TEMPLATE
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<role>SYSTEM</role>Answer briefly.<role>HUMAN</role>Hi there<role>ASSISTANT</role>Hello."
        "<role>HUMAN</role>Who are you?<role>ASSISTANT</role>"
    )
    done = tok.apply_chat_template(MESSAGES + [{"role": "assistant", "content": "A model."}], tokenize=False)
    assert done.endswith("<role>ASSISTANT</role>A model.<|endoftext|>")
    # flood renders the checkpoint's template to the same text, with the same special tokens.
    from lingctl.flood.weights.model_dir import ModelDir
    from lingctl.model.chat_template import TemplateRenderer

    model_dir = ModelDir.open(path)
    with TemplateRenderer(model_dir.chat_template() or "") as renderer:
        for messages in (MESSAGES, MESSAGES + [{"role": "assistant", "content": "A model."}]):
            for add in (True, False):
                assert renderer.render(
                    messages, add_generation_prompt=add, special_tokens=model_dir.special_tokens()
                ) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    # The role markers are single special tokens, as on Ling's tokenizer.
    ids = tok.apply_chat_template(MESSAGES[1:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<role>") and ids[-1] == tok.convert_tokens_to_ids("</role>")


def test_auto_map_loads_ling_config_through_transformers(tmp_path: Path, sharded: tuple[Path, LingForCausalLM]) -> None:
    """transformers follows config.json's auto_map, offline, to the configuration code: in a Hub repository in
    the cache (``code_repo``: the repository there holds lingctl's configuration_bailing_moe.py as Ling's
    module, and no code is written beside the weights) and beside the weights (the default)."""
    pytest.importorskip("transformers")
    from tests.support.hf_cache import cache_repo

    path, model = sharded
    code = tmp_path / "code"
    code.mkdir()
    shutil.copyfile(REPO / "lingctl/model/hf_code/configuration_bailing_moe.py", code / "configuration_bailing_moe.py")
    hf_home = tmp_path / "hf"
    cache_repo(hf_home, LING_CODE_REPO, code)
    hub_form = tmp_path / "hub_form"
    save_checkpoint(model, hub_form, code_repo=LING_CODE_REPO)
    config = json.loads((hub_form / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == f"{LING_CODE_REPO}--modeling_bailing_moe.BailingMoeForCausalLM"
    assert not list(hub_form.glob("*.py"))
    script = (
        "import sys, json\nfrom transformers import AutoConfig\n"
        "for p in sys.argv[1:]:\n"
        "    c = AutoConfig.from_pretrained(p, trust_remote_code=True)\n"
        "    print(json.dumps([type(c).__name__, c.model_type, c.num_experts, c.num_experts_per_tok,"
        " c.hidden_size, c.norm_head]))\n"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_HUB_CACHE", None)
    res = subprocess.run(
        [sys.executable, "-c", script, str(hub_form), str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    c = model.config
    want = ["BailingMoeConfig", "bailing_moe", c.num_experts, c.num_experts_per_tok, c.hidden_size, c.norm_head]
    assert [json.loads(line) for line in res.stdout.splitlines()] == [want, want]


# What vLLM's bailing_moe loader (vllm/model_executor/models/bailing_moe.py) reads from a checkpoint
# directory; docs/train.md lists the same.
VLLM_CONFIG_FIELDS = (
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "num_shared_experts",
    "norm_topk_prob",
    "first_k_dense_replace",
    "rms_norm_eps",
    "rope_theta",
    "use_bias",
    "use_qkv_bias",
    "tie_word_embeddings",
    "norm_head",
    "embedding_dropout",
    "torch_dtype",
)
VLLM_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "attention.query_key_value.weight",
    "attention.dense.weight",
)
VLLM_MOE_WEIGHTS = (
    "mlp.gate.weight",
    "mlp.experts.{e}.gate_proj.weight",
    "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
)
VLLM_DENSE_WEIGHTS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def test_vllm_bailing_moe_checklist(sharded: tuple[Path, LingForCausalLM]) -> None:
    path, _ = sharded
    config = json.loads((path / "config.json").read_text())
    missing = [f for f in VLLM_CONFIG_FIELDS if f not in config]
    assert not missing
    assert config["architectures"] == ["BailingMoeForCausalLM"]
    assert config.get("rope_scaling") is None  # vLLM reads RoPE from rope_theta (rope_parameters in transformers 5)
    names = set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"])
    expected = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{w}" for w in VLLM_LAYER_WEIGHTS}
        if i < config["first_k_dense_replace"]:
            expected |= {f"model.layers.{i}.{w}" for w in VLLM_DENSE_WEIGHTS}
        else:
            expected |= {
                f"model.layers.{i}.{w.format(e=e)}" for w in VLLM_MOE_WEIGHTS for e in range(config["num_experts"])
            }
    assert names == expected
    # query_key_value is one fused matrix: q heads, then k, then v.
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    from safetensors import safe_open

    index = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
    name = "model.layers.0.attention.query_key_value.weight"
    with safe_open(str(path / index[name]), framework="pt") as f:
        assert list(f.get_slice(name).get_shape()) == [q + 2 * kv, config["hidden_size"]]
