from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest

from lingctl.core.errors import LingctlError, UsageError
from lingctl.model.config import LingConfig
from lingctl.model.ling import DecoderLayer, LingForCausalLM
from lingctl.model.presets import PRESETS, preset

# Keys a Hugging Face loader (vLLM, SGLang, transformers' BailingMoeConfig) needs spelled out: a missing one
# would silently take BailingMoeConfig's class default, which differs from Ling-lite for several of them.
HF_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "norm_topk_prob",
    "norm_head",
    "rope_theta",
    "rms_norm_eps",
    "vocab_size",
    "tie_word_embeddings",
    "use_bias",
    "use_qkv_bias",
    "max_position_embeddings",
    "pad_token_id",
)


def tiny(**overrides: object) -> LingConfig:
    fields: dict[str, object] = dict(
        vocab_size=97,
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
        pad_token_id=0,
        eos_token_id=0,
    )
    fields.update(overrides)
    return LingConfig(**fields)  # type: ignore[arg-type]


def minimal_hf(**overrides: object) -> dict[str, object]:
    """A config.json with only the keys whose class default would not validate for a small model."""
    data: dict[str, object] = {
        "model_type": "bailing_moe",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "pad_token_id": 0,
    }
    data.update(overrides)
    return data


# --- config.json ------------------------------------------------------------------------------------------


def test_hf_dict_round_trip_and_required_keys() -> None:
    config = LingConfig()
    data = config.to_hf_dict()
    assert data["model_type"] == "bailing_moe"
    assert data["architectures"] == ["BailingMoeForCausalLM"]
    missing = [key for key in HF_KEYS if key not in data]
    assert missing == []
    assert LingConfig.from_hf_dict(data) == config


def test_hf_file_round_trip_through_json(tmp_path: Path) -> None:
    config = tiny(rope_theta=600000.0, norm_head=False, use_bias=True, tie_word_embeddings=True)
    config.save(tmp_path / "config.json")
    assert LingConfig.load(tmp_path / "config.json") == config
    assert json.loads((tmp_path / "config.json").read_text())["norm_head"] is False


def test_integer_rope_theta_reads_as_float() -> None:
    # Published Ling config.json files write "rope_theta": 600000, an integer.
    config = LingConfig.from_hf_dict(minimal_hf(rope_theta=600000))
    assert config.rope_theta == 600000.0
    assert isinstance(config.rope_theta, float)


def test_omitted_keys_take_bailing_class_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(minimal_hf()))
    config = LingConfig.load(tmp_path / "config.json")
    # BailingMoeConfig's class defaults, not Ling-lite's dataclass defaults.
    assert config.use_bias is True
    assert config.norm_head is False
    assert config.rope_theta == 10000.0
    assert config.head_dim == 64 // 4
    assert config.num_key_value_heads == 4
    # The default reaches the built model: use_bias puts a bias on attention.dense.
    model = LingForCausalLM(config)
    assert cast(DecoderLayer, model.model.layers[0]).attention.dense.bias is not None


def test_wrong_model_type_is_an_error() -> None:
    with pytest.raises(LingctlError, match="model_type") as info:
        LingConfig.from_hf_dict(minimal_hf(model_type="llama"))
    assert "llama" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": 16}, "num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
    ],
)
def test_invalid_shapes_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(UsageError) as info:
        LingConfig.from_hf_dict(minimal_hf(**overrides))
    assert field in str(info.value)


# --- presets ----------------------------------------------------------------------------------------------


def test_ling_lite_parameter_counts_match_the_published_sizes() -> None:
    config = preset("ling-lite")
    total, active = config.num_parameters(), config.num_parameters(active=True)
    assert abs(total - 16.8e9) / 16.8e9 < 0.01, total
    assert abs(active - 2.75e9) / 2.75e9 < 0.02, active


def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(UsageError, match="nope") as info:
        preset("nope")
    assert info.value.hint is not None
    for name in PRESETS:
        assert name in info.value.hint


def test_preset_returns_a_copy() -> None:
    original = PRESETS["tiny"].hidden_size
    config = preset("tiny")
    assert config == PRESETS["tiny"]
    config.hidden_size = original * 2
    assert PRESETS["tiny"].hidden_size == original
    assert preset("tiny").hidden_size == original


# --- parameter count --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"first_k_dense_replace": 1},
        {"use_bias": True, "use_qkv_bias": True},
        {"num_shared_experts": 2, "num_hidden_layers": 3, "first_k_dense_replace": 1, "tie_word_embeddings": True},
    ],
    ids=["plain", "tied", "dense-first", "biases", "mixed"],
)
def test_num_parameters_equals_the_built_model(overrides: dict[str, object]) -> None:
    config = tiny(**overrides)
    model = LingForCausalLM(config)
    # parameters() yields a tied weight once, as the count should.
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_active_parameters_count_k_routed_experts() -> None:
    config = tiny(num_experts=6, num_experts_per_tok=2)
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    assert config.num_parameters() - config.num_parameters(active=True) == moe_layers * (6 - 2) * expert
