"""Ling's ``BailingMoeConfig`` for transformers: the fields of config.json with Ling's class defaults.

Written beside a checkpoint's weights by lingctl; config.json's ``auto_map`` names this file. The fields are
class attributes with annotations: transformers 5 turns them into a dataclass, transformers 4 keeps them as
class defaults and sets every config.json value as an attribute, so one file serves both.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PretrainedConfig


class BailingMoeConfig(PretrainedConfig):
    model_type = "bailing_moe"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    vocab_size: int = 30592
    hidden_size: int = 1024
    intermediate_size: int | None = None
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 0
    head_dim: int | None = None
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_bias: bool = True
    rms_norm_eps: float = 1e-5
    # NormHead: each column of lm_head.weight divided by its L2 norm over the vocabulary.
    norm_head: bool = False
    tie_word_embeddings: bool = False
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    output_dropout: float = 0.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 16384
    # transformers 5 moves a config.json's rope_theta into rope_parameters; transformers 4 keeps rope_theta.
    rope_parameters: dict[str, Any] | None = None
    use_cache: bool = True
    use_sliding_window: bool = False
    sliding_window: int = 4096
    max_window_layers: int = 28
    num_experts: int = 16
    num_shared_experts: int = 0
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    moe_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    output_router_logits: bool = False
    pad_token_id: int | None = 126081
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
