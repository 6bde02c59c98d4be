"""Memory plan: will the runtime, the weights, the loader's buffers, the activations of one step and a KV cache
big enough for the batch fit?

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
from lingctl.flood.engine.forward import MIN_ROWS
from lingctl.flood.engine.segment_cache import KVPool
from lingctl.flood.weights.loader import temp_bytes
from lingctl.flood.weights.quantize import INT8_MODES, dense_weight_bytes, int8_head, int8_weight_bytes
from lingctl.model.config import LingConfig

HEADROOM = 0.9
# What the process grows by beyond its tensors once it loads and runs: library code paged in by the first
# quantization and forward kernels, and allocator fragments between the small tensors that stay (measured
# 60-90 MB after loading 0.5 GB of weights, and after malloc_trim).
RUNTIME_GROWTH = 64 * 2**20


@dataclass(kw_only=True, slots=True)
class MemoryPlan:
    """What the process will hold at its peak, part by part (bytes). The loader's temporaries are freed
    before the engine starts, so the peak is the runtime and the weights plus the larger of (loader
    temporaries) and (engine copies + activations of one step + KV cache)."""

    params: int
    active_params: int
    dtype: str
    quantize: str | None
    runtime_bytes: int  # the process as measured at planning time (interpreter, torch, tokenizer) + RUNTIME_GROWTH
    weights_bytes: int  # in their final form (int8 rows + scales, float embeddings/head/norms/routers)
    loader_bytes: int  # read buffers, float32 rows being quantized, NormHead baking
    engine_bytes: int  # copies of float weights the engine lays out for its kernels (oneDNN-packed linears)
    activation_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    kv_bytes: int
    total_bytes: int
    available_bytes: int
    batch_kv_tokens: int  # what the whole batch could use at most
    largest_request_tokens: int


def weights_bytes(config: LingConfig, dtype: torch.dtype, quantize: str | None) -> int:
    if quantize in INT8_MODES:
        return int8_weight_bytes(config, dtype, include_head=int8_head(quantize, dtype))
    return dense_weight_bytes(config, dtype)


def engine_bytes(config: LingConfig, dtype: torch.dtype, quantize: str | None) -> int:
    """The engine keeps a oneDNN-packed copy of each float linear it multiplies through oneDNN (see
    ``lingctl.flood.engine.packed``): the head always, and without int8 the attention projections and the dense
    and shared-expert MLPs (routed experts are not packed)."""
    try:
        from lingctl.flood.engine.packed import available
    except ImportError:  # an engine without packed linears
        return 0
    if dtype not in (torch.float32, torch.bfloat16) or not available(dtype):
        return 0
    d = config.hidden_size
    head = 0 if int8_head(quantize, dtype) else config.vocab_size * d  # an int8 head is not packed
    total = head
    if quantize is None:
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        total += config.num_hidden_layers * (qkv + config.num_attention_heads * config.head_dim) * d
        n_dense = config.first_k_dense_replace
        total += n_dense * 3 * d * (config.intermediate_size or 0)
        total += (config.num_hidden_layers - n_dense) * 3 * d * config.moe_intermediate_size * config.num_shared_experts
    # Packing one weight holds a second transient copy of it inside oneDNN (measured: +2x the weight at peak,
    # +1x after), so the largest packed weight, the head, counts twice while the engine starts.
    return (total + head) * dtype.itemsize


def activation_bytes(
    config: LingConfig,
    step_tokens: int,
    sample_rows: int,
    dtype: torch.dtype = torch.float32,
    quantize: str | None = None,
) -> int:
    """Peak temporaries of one step of ``step_tokens`` rows of which ``sample_rows`` sample (both already
    padded to the 4-row minimum), following what the forward pass allocates:

    - per token, in the model dtype: the residual stream and norm outputs (float32 inside RMSNorm), q/k/v
      before and after RoPE, the attention output, the shared expert's gate/up/product;
    - per routed slot (token x k): the gathered input, the expert's gate/up/product and output, and the
      float32 weighted copy that is summed;
    - with int8, the widest linear widened to the model dtype (``Int8Linear.forward``), one at a time;
    - the head: logits in the model dtype, their float32 copy and the sampler's float32 work on them.
    """
    size = dtype.itemsize
    d, v = config.hidden_size, config.vocab_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    width = config.moe_intermediate_size
    shared = max(
        config.intermediate_size if config.first_k_dense_replace else 0, width * max(1, config.num_shared_experts)
    )
    per_token = size * (6 * d + 3 * qkv + 3 * shared) + 4 * 3 * d
    per_slot = size * (2 * d + 3 * width) + 4 * d
    routed = config.num_experts_per_tok if config.num_experts else 0
    acts = step_tokens * (per_token + routed * per_slot)
    if quantize in INT8_MODES:
        widest = max(qkv, config.num_attention_heads * config.head_dim, shared, width) * d
        acts += widest * size
    return acts + sample_rows * v * (size + 3 * 4)


def check_weights_fit(
    config: LingConfig,
    *,
    dtype: torch.dtype,
    quantize: str | None,
    available_bytes: int | None = None,
    converted: bool = False,
) -> None:
    """The part of the plan that needs no requests: refuse at once, before any file is opened for output or
    any weight byte is read, a model whose weights and load buffers alone exceed the available memory."""
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    weights = weights_bytes(config, dtype, quantize)
    loader = temp_bytes(config, dtype, quantize, converted=converted)
    if weights + loader > available_bytes:
        raise _too_big(weights, loader, dtype, quantize, available_bytes)


def _too_big(
    weights: int, temporaries: int, dtype: torch.dtype, quantize: str | None, available_bytes: int
) -> LingctlError:
    hint = "try --quantize int8" if quantize is None else "use a machine with more memory, or --stages on several"
    return LingctlError(
        f"the model needs {format_size(weights)} of weights ({str(dtype).removeprefix('torch.')}"
        f"{', int8' if quantize else ''}) + {format_size(temporaries)} of engine copies, activations "
        f"and load buffers; {format_size(available_bytes)} is available",
        hint=hint,
    )


def _kv_tokens(given: int | None, room: int, per_token: int, batch_kv_tokens: int, largest_request_tokens: int) -> int:
    """The KV cache size in tokens: ``given`` (--kv-cache-tokens), or what the batch needs, within ``room``
    bytes; a LingctlError when it does not fit there or cannot hold the largest request."""
    budget = room // per_token
    if given is None:
        kv_tokens = min(budget, max(batch_kv_tokens, largest_request_tokens))
    else:
        kv_tokens = given
        if kv_tokens > budget:
            raise LingctlError(
                f"--kv-cache-tokens {kv_tokens} needs {format_size(kv_tokens * per_token)}; only "
                f"{format_size(room)} is left after weights and activations",
                hint=f"use at most --kv-cache-tokens {budget}",
            )
    if kv_tokens < largest_request_tokens:
        raise LingctlError(
            f"the KV cache holds {kv_tokens} tokens but the largest request needs "
            f"{largest_request_tokens} (prompt + 1)",
            hint="raise --kv-cache-tokens, or lower max_tokens/shorten that prompt",
        )
    return kv_tokens


def plan_memory(
    config: LingConfig,
    *,
    dtype: torch.dtype,
    quantize: str | None,
    kv_cache_tokens: int | None,
    converted: bool = False,
    max_batch_tokens: int,
    max_seqs: int,
    batch_kv_tokens: int,
    largest_request_tokens: int,
    available_bytes: int | None = None,
    runtime_bytes: int | None = None,
) -> MemoryPlan:
    """The plan, or a one-line LingctlError saying what does not fit and what to try. ``max_batch_tokens``
    and ``max_seqs`` are what one step can hold at most (callers cap them by what the batch has);
    ``runtime_bytes`` defaults to this process's resident memory now, which is why the caller plans after
    everything but the weights is loaded (torch, the tokenizer, the requests)."""
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    if runtime_bytes is None:
        runtime_bytes = psutil.Process().memory_info().rss + RUNTIME_GROWTH
    per_token = KVPool.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)
    weights = weights_bytes(config, dtype, quantize)
    loader = temp_bytes(config, dtype, quantize, converted=converted)
    engine = engine_bytes(config, dtype, quantize)
    acts = activation_bytes(config, max(MIN_ROWS, max_batch_tokens), max(MIN_ROWS, max_seqs), dtype, quantize)
    # The runtime is already resident, so it is not part of what must still be available.
    left = available_bytes - weights - engine - acts
    if left <= 0 or weights + loader > available_bytes:
        raise _too_big(weights, max(engine + acts, loader), dtype, quantize, available_bytes)
    kv_tokens = _kv_tokens(kv_cache_tokens, int(left * HEADROOM), per_token, batch_kv_tokens, largest_request_tokens)
    kv_tokens = max(1, kv_tokens)
    kv = kv_tokens * per_token
    return MemoryPlan(
        params=config.num_parameters(),
        active_params=config.num_parameters(active=True),
        dtype=str(dtype).removeprefix("torch."),
        quantize=quantize,
        runtime_bytes=runtime_bytes,
        weights_bytes=weights,
        loader_bytes=loader,
        engine_bytes=engine,
        activation_bytes=acts,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        kv_bytes=kv,
        total_bytes=runtime_bytes + weights + max(loader, engine + acts + kv),
        available_bytes=available_bytes,
        batch_kv_tokens=batch_kv_tokens,
        largest_request_tokens=largest_request_tokens,
    )
