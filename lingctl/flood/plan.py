"""Memory plan: will the weights, the activations of one step and a KV cache big enough for the batch fit?

Answered from config.json alone (no weights read), so ``--dry-run`` fails in a second for a model that would
otherwise load for minutes and then run out of memory. The default KV budget is what the batch could use
at most (every request's prompt + max_tokens, shared prefixes once), capped at 90% of the memory left after
weights and activations, as vLLM leaves headroom with ``gpu_memory_utilization``.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from lingctl.core.errors import LingctlError
from lingctl.core.units import format_size
from lingctl.flood.quantize import dense_weight_bytes, int8_weight_bytes
from lingctl.flood.segment_cache import KVPool
from lingctl.model.config import LingConfig

HEADROOM = 0.9


@dataclass(kw_only=True, slots=True)
class MemoryPlan:
    params: int
    active_params: int
    dtype: str
    quantize: str | None
    weights_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    kv_bytes: int
    available_bytes: int
    batch_kv_tokens: int  # what the whole batch could use at most
    largest_request_tokens: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.kv_bytes


def weights_bytes(config: LingConfig, dtype: torch.dtype, quantize: str | None) -> int:
    if quantize == "int8":
        return int8_weight_bytes(config, dtype)
    return dense_weight_bytes(config, dtype)


def activation_bytes(config: LingConfig, max_batch_tokens: int, max_seqs: int) -> int:
    """Peak temporaries of one step, float32: a handful of [T, D] buffers, the widest MLP or expert
    activations, q/k/v, and the logits of the rows that sample."""
    d = config.hidden_size
    inter = max(config.intermediate_size, config.moe_intermediate_size * max(1, config.num_shared_experts))
    routed = config.moe_intermediate_size * config.num_experts_per_tok
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = 8 * d + 3 * max(inter, routed) + 2 * qkv
    return 4 * (max_batch_tokens * per_token + max_seqs * config.vocab_size * 2)


def plan_memory(config: LingConfig, *, dtype: torch.dtype, quantize: str | None, kv_cache_tokens: int | None,
                max_batch_tokens: int, max_seqs: int, batch_kv_tokens: int, largest_request_tokens: int,
                available_bytes: int | None = None) -> MemoryPlan:
    """The plan, or a one-line LingctlError saying what does not fit and what to try."""
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    per_token = KVPool.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)
    weights = weights_bytes(config, dtype, quantize)
    acts = activation_bytes(config, max_batch_tokens, max_seqs)
    dtype_name = str(dtype).removeprefix("torch.")
    left = available_bytes - weights - acts
    if left <= 0:
        hint = "try --quantize int8" if quantize is None else "use a machine with more memory, or --stages on several"
        raise LingctlError(f"the model needs {format_size(weights)} of weights ({dtype_name}"
                           f"{', int8' if quantize else ''}) + {format_size(acts)} of activations; "
                           f"{format_size(available_bytes)} is available", hint=hint)
    budget = int(left * HEADROOM) // per_token
    if kv_cache_tokens is None:
        kv_tokens = min(budget, max(batch_kv_tokens, largest_request_tokens))
    else:
        kv_tokens = kv_cache_tokens
        if kv_tokens > budget:
            raise LingctlError(f"--kv-cache-tokens {kv_tokens} needs {format_size(kv_tokens * per_token)}; only "
                               f"{format_size(int(left * HEADROOM))} is left after weights and activations",
                               hint=f"use at most --kv-cache-tokens {budget}")
    if kv_tokens < largest_request_tokens:
        raise LingctlError(f"the KV cache holds {kv_tokens} tokens but the largest request needs "
                           f"{largest_request_tokens} (prompt + 1)",
                           hint="raise --kv-cache-tokens, or lower max_tokens/shorten that prompt")
    return MemoryPlan(params=config.num_parameters(), active_params=config.num_parameters(active=True),
                      dtype=dtype_name, quantize=quantize, weights_bytes=weights, activation_bytes=acts,
                      kv_bytes_per_token=per_token, kv_tokens=max(1, kv_tokens), kv_bytes=kv_tokens * per_token,
                      available_bytes=available_bytes, batch_kv_tokens=batch_kv_tokens,
                      largest_request_tokens=largest_request_tokens)
