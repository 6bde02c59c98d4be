"""Named model shapes: ``tiny`` (tests), ``small`` (the demo), and Ling-lite / Ling-plus as published.

``tiny`` and ``small`` take their vocabulary size from the tokenizer trained for the run, so the value
here is only the default; the token ids of ``pad``/``eos`` are also set from the tokenizer at build time.
"""

from __future__ import annotations

import dataclasses

from lingctl.core.errors import UsageError
from lingctl.model.config import LingConfig

PRESETS: dict[str, LingConfig] = {
    # Well under a second per training step on one CPU core; exercises a dense first layer and GQA.
    "tiny": LingConfig(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        rope_theta=10000.0,
        initializer_range=0.02,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=0,
        torch_dtype="float32",
    ),
    # The demo: ~2 minutes on 2 CPU cores shows a clear loss drop. Fine-grained experts, one shared.
    "small": LingConfig(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=1024,
        num_experts=16,
        num_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        first_k_dense_replace=0,
        rope_theta=10000.0,
        initializer_range=0.02,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=0,
        torch_dtype="float32",
    ),
    # Published shapes (inclusionAI/Ling-lite and Ling-plus config.json).
    "ling-lite": LingConfig(),
    "ling-plus": LingConfig(
        hidden_size=5376,
        num_hidden_layers=88,
        num_attention_heads=56,
        num_key_value_heads=8,
        head_dim=96,
        intermediate_size=18432,
        num_experts=64,
        num_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=3072,
    ),
}


def preset(name: str) -> LingConfig:
    """A fresh copy of the named preset (callers may change fields)."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown model preset {name!r}", hint=f"choose one of: {', '.join(PRESETS)}") from None
    return dataclasses.replace(config)
