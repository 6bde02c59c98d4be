"""Ling's configuration class for a checkpoint that vLLM loads (copied into it as configuration_bailing_moe.py).

vLLM serves ``BailingMoeForCausalLM`` natively, but it reads the checkpoint's config.json through transformers,
which has no ``bailing_moe`` model type; the checkpoint's ``auto_map`` points transformers at this file instead
(so vLLM needs ``trust_remote_code=True``). It holds the fields of Ling's own ``BailingMoeConfig`` with that
class's defaults, in the dataclass form of transformers 5 configs, and nothing else: no modeling code, since
vLLM brings its own.

Imported only by transformers inside the vLLM virtual environment (``make bench-vllm``), never by lingctl.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig


class BailingMoeConfig(PretrainedConfig):
    model_type = "bailing_moe"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    vocab_size: int = 30592
    hidden_size: int = 1024
    intermediate_size: int | None = None
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 0
    head_dim: int | None = None
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_bias: bool = True
    rms_norm_eps: float = 1e-5
    # Ling's NormHead: lm_head columns divided by their L2 norm over the vocabulary. vLLM applies it once, to
    # the weights it loads (F.normalize(dim=0)), never per token.
    norm_head: bool = False
    tie_word_embeddings: bool = False
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    output_dropout: float = 0.0
    initializer_range: float = 0.02
    max_position_embeddings: int = 16384
    # transformers 5 keeps RoPE settings in one dict; a config.json's rope_theta is moved into it on load.
    rope_parameters: dict | None = None
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
