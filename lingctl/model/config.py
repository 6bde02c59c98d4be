"""The Ling (``bailing_moe``) model config, field for field as Hugging Face ``config.json`` names it.

Field names and meanings follow the public Ling-lite / Ling-plus checkpoints so that a real Ling checkpoint's
``config.json`` reads directly and ours reads in other tools (vLLM, SGLang, llama.cpp converters). Two sets
of defaults matter:

- the dataclass defaults below are Ling-lite's own values (what a user expects from "a Ling model");
- ``BAILING_CLASS_DEFAULTS`` are the defaults of Ling's ``BailingMoeConfig`` Python class, which differ
  (``use_bias=True``, ``norm_head=False``, ``rope_theta=1e4``, ...). A ``config.json`` that omits a field
  means the *class* default, because that is what Hugging Face loaders fill in; so reading uses the class
  defaults and writing spells out every field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, NotFoundError, UsageError
from lingctl.model.checkpoint_files import CONFIG

MODEL_TYPE = "bailing_moe"
ARCHITECTURE = "BailingMoeForCausalLM"

# Defaults of Ling's BailingMoeConfig class (configuration_bailing_moe.py): what a missing key means.
BAILING_CLASS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30592,
    "hidden_size": 1024,
    "intermediate_size": None,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 0,
    "hidden_act": "silu",
    "use_qkv_bias": False,
    "use_bias": True,
    "rms_norm_eps": 1e-5,
    "norm_head": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "max_position_embeddings": 16384,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "pad_token_id": 126081,
    "bos_token_id": None,
    "eos_token_id": None,
    "num_experts": 16,
    "num_shared_experts": 0,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "moe_intermediate_size": None,
    "first_k_dense_replace": 0,
    "head_dim": None,
}


@dataclass(kw_only=True, slots=True)
class LingConfig:
    """Shapes and options of a Ling MoE model. Defaults: Ling-lite (hidden 2048, 28 layers, 64 experts top-6)."""

    vocab_size: int = 126464
    hidden_size: int = 2048
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    # Grouped-query attention: query head h reads KV head h // (num_attention_heads // num_key_value_heads).
    num_key_value_heads: int = 4
    # May differ from hidden_size / num_attention_heads; the attention scale is 1/sqrt(head_dim).
    head_dim: int = 128
    # Width of the dense SwiGLU MLP used by the first `first_k_dense_replace` layers.
    intermediate_size: int = 5632
    num_experts: int = 64
    # The shared expert is ONE always-on MLP of width moe_intermediate_size * num_shared_experts.
    num_shared_experts: int = 2
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1408
    first_k_dense_replace: int = 0
    # Renormalise the top-k router probabilities to sum to 1 (only when k > 1, as Ling does).
    norm_topk_prob: bool = True
    # NormHead: the LM head weight is divided by its L2 norm over the vocabulary dimension.
    norm_head: bool = True
    rope_theta: float = 600000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # Bias on the attention output projection `attention.dense`; MLPs and the router never have biases.
    use_bias: bool = False
    use_qkv_bias: bool = False
    max_position_embeddings: int = 16384
    hidden_act: str = "silu"
    initializer_range: float = 0.006
    pad_token_id: int = 126081
    bos_token_id: int | None = None
    eos_token_id: int = 126081
    torch_dtype: str = "bfloat16"

    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UsageError(f"model config: {name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            # NaN compares false both ways, so a plain "<= 0" would let it through into the rotary tables.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UsageError(f"model config: {name} must be a finite number > 0, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UsageError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UsageError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise UsageError(
                f"model config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise UsageError(
                f"model config: first_k_dense_replace must be in [0, {self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}"
            )
        if self.first_k_dense_replace and (self.intermediate_size or 0) <= 0:
            raise UsageError("model config: intermediate_size must be set when first_k_dense_replace > 0")
        if self.num_shared_experts < 0:
            raise UsageError(f"model config: num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.hidden_act != "silu":
            raise UsageError(f"model config: only hidden_act 'silu' (SwiGLU) is supported, got {self.hidden_act!r}")
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                # Ling-style ids past the vocabulary would index out of range in the embedding.
                raise UsageError(f"model config: {name} {value} is outside the vocabulary (size {self.vocab_size})")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    # -- parameter counts (for planning and for the run summary) ------------------------------------
    def num_parameters(self, *, active: bool = False) -> int:
        """Total parameters, or with ``active=True`` those one token uses (k routed experts, not E)."""
        h = self.hidden_size
        attn = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        attn += self.num_attention_heads * self.head_dim * h
        if self.use_qkv_bias:
            attn += (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        if self.use_bias:
            attn += h
        expert = 3 * h * self.moe_intermediate_size
        routed = self.num_experts_per_tok if active else self.num_experts
        moe = routed * expert + self.num_shared_experts * expert + self.num_experts * h
        dense = 3 * h * (self.intermediate_size or 0)
        n_dense = self.first_k_dense_replace
        layers = self.num_hidden_layers * (attn + 2 * h) + n_dense * dense + (self.num_hidden_layers - n_dense) * moe
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return layers + embed + head + h

    # -- Hugging Face config.json ---------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """Every field explicit, so no reader falls back to BailingMoeConfig's differing class defaults."""
        data: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        data.update(dataclasses.asdict(self))
        # No rope_scaling key: null is its default everywhere, and transformers 5 warns that the key is deprecated.
        data.update(
            {
                "attention_dropout": 0.0,
                "embedding_dropout": 0.0,
                "output_dropout": 0.0,
                "use_cache": True,
                "use_sliding_window": False,
                "output_router_logits": False,
            }
        )
        return data

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, source: str = CONFIG) -> LingConfig:
        model_type = data.get("model_type")
        if model_type != MODEL_TYPE:
            raise LingctlError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r} (a Ling checkpoint)")
        if data.get("rope_scaling"):
            raise LingctlError(f"{source}: rope_scaling {data['rope_scaling']!r} is not supported")
        merged = dict(BAILING_CLASS_DEFAULTS)
        merged.update({k: v for k, v in data.items() if v is not None or k in ("bos_token_id",)})
        hidden, heads = merged["hidden_size"], merged["num_attention_heads"]
        # The class derives these when they are absent or null.
        if not merged.get("head_dim"):
            merged["head_dim"] = hidden // heads
        if not merged.get("num_key_value_heads"):
            merged["num_key_value_heads"] = heads
        if not merged.get("moe_intermediate_size"):
            merged["moe_intermediate_size"] = merged.get("intermediate_size") or 4 * hidden
        if merged.get("intermediate_size") is None:
            merged["intermediate_size"] = 0
        eos = merged.get("eos_token_id")
        if isinstance(eos, list):  # some configs list several stop ids; the first is the document end
            merged["eos_token_id"] = eos[0] if eos else merged["pad_token_id"]
        elif eos is None:
            merged["eos_token_id"] = merged["pad_token_id"]
        if "torch_dtype" not in merged and "dtype" in merged:
            merged["torch_dtype"] = merged["dtype"]
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in merged:
                kwargs[f.name] = merged[f.name]
        try:
            config = cls(**kwargs)
        except TypeError as exc:
            raise LingctlError(f"{source}: {exc}") from None
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            setattr(config, name, float(getattr(config, name)))
        config.validate()
        return config

    def save(self, path: Path) -> None:
        from lingctl.core.atomic import atomic_write

        with atomic_write(Path(path)) as (_, f):
            f.write((json.dumps(self.to_hf_dict(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> LingConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"no {CONFIG} at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise LingctlError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise LingctlError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(data, source=str(path))
