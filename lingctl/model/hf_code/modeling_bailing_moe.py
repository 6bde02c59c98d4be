"""Ling's MoE decoder (``BailingMoeForCausalLM``) for transformers, computing what lingctl's own model computes.

Written beside a checkpoint's weights by lingctl; config.json's ``auto_map`` names this file, so

    AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).generate(...)

runs offline on transformers 4.46 through 5.x, with the key/value cache. Parameter names are those of Ling's
checkpoints. The arithmetic follows lingctl's model step for step (RMSNorm in float32 then the weight, RoPE
angles in float32, a float32 softmax router with renormalised top-k, the k expert outputs summed in float32,
NormHead in float32), so log-likelihoods agree with lingctl's to rounding and greedy outputs are the same.

Only what transformers' generation and evaluation loops use is here: no attention weights output, no router
losses (fine-tuning with a balance loss is ``lingctl train``'s job).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_bailing_moe import BailingMoeConfig

NORM_HEAD_EPS = 1e-7
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
# transformers 5.2x calls the key/value cache ``cache`` (argument and output field); earlier ones past_key_values.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _shape(config: Any) -> tuple[int, int, int, float]:
    """Heads, key/value heads, head size and RoPE base, derived as Ling's class derives missing ones."""
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = config.head_dim or config.hidden_size // heads
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return heads, kv_heads, head_dim, float(theta if theta is not None else 10000.0)


class BailingMoeRMSNorm(nn.Module):
    """Normalised in float32, cast back, *then* scaled by the weight: the order matters for bf16 results."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)


def _rope(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, S, Dh] for rotate-half RoPE; angles in float32 whatever the model's dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class BailingMoeAttention(nn.Module):
    """Causal grouped-query attention with Ling's fused projection [all Q heads | all K heads | all V heads]."""

    def __init__(self, config: BailingMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim, _ = _shape(config)
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, width, bias=config.use_qkv_bias)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # query head h reads key/value head h // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # No mask: a whole causal sequence (is_causal) or one new token that sees everything before it.
        causal = mask is None and s > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.dense(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class BailingMoeMLP(nn.Module):
    """SwiGLU: the dense MLP, each routed expert and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BailingMoeGate(nn.Module):
    """``mlp.gate``: float32 softmax over the experts, top-k, renormalised when ``norm_topk_prob`` and k > 1."""

    def __init__(self, config: BailingMoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).to(torch.float32).softmax(dim=-1)
        weight, idx = torch.topk(probs, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight


class BailingMoeSparseMoeBlock(nn.Module):
    """Routed experts weighted by the gate (every token reaches all k of its experts) plus the shared expert."""

    def __init__(self, config: BailingMoeConfig) -> None:
        super().__init__()
        width = config.moe_intermediate_size or config.intermediate_size or 4 * config.hidden_size
        self.gate = BailingMoeGate(config)
        self.experts = nn.ModuleList(BailingMoeMLP(config.hidden_size, width) for _ in range(config.num_experts))
        self.shared_experts = (
            BailingMoeMLP(config.hidden_size, width * config.num_shared_experts) if config.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        x_td = x.reshape(b * s, d)
        idx, weight = self.gate(x_td)
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = x_td[order // k]
        outs = [expert(chunk) for expert, chunk, n in zip(self.experts, rows.split(counts), counts) if n]
        # The k weighted expert outputs of a token are summed in float32.
        ys = torch.cat(outs).to(torch.float32) * weight.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros(b * s, d, dtype=torch.float32, device=x.device).index_add_(0, order // k, ys)
        out = y.to(x.dtype).view(b, s, d)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class BailingMoeDecoderLayer(nn.Module):
    def __init__(self, config: BailingMoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = BailingMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = BailingMoeAttention(config, layer_idx)
        self.post_attention_layernorm = BailingMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = BailingMoeSparseMoeBlock(config)
        else:
            self.mlp = BailingMoeMLP(config.hidden_size, config.intermediate_size or 4 * config.hidden_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, cache: Cache | None
    ) -> torch.Tensor:
        h = x + self.attention(self.input_layernorm(x), rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class BailingMoePreTrainedModel(PreTrainedModel):
    config_class = BailingMoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["BailingMoeDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_cache_class = True  # transformers 4: generate() hands forward a DynamicCache
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, BailingMoeGate)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, BailingMoeRMSNorm):
            nn.init.ones_(module.weight)


def _attention_mask(
    attention_mask: torch.Tensor | None, past: int, q_len: int, device: torch.device
) -> torch.Tensor | None:
    """The boolean mask [B, 1, S, past + S] SDPA takes (True: may attend), or None where plain causal
    attention is exact: no padding and either no cached tokens or a single new token."""
    if attention_mask is not None and attention_mask.dim() == 4:  # already expanded by the caller
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (past == 0 or q_len == 1):
        return None
    total = past + q_len
    causal = torch.ones(q_len, total, dtype=torch.bool, device=device).tril(diagonal=past)[None, None]
    if not padded:
        return causal
    assert attention_mask is not None
    mask = causal & attention_mask[:, None, None, -total:].to(torch.bool)
    # A padding position's own row would be all False (NaN from softmax): let it see everything; its output
    # is never used.
    return mask | ~mask.any(dim=-1, keepdim=True)


class BailingMoeModel(BailingMoePreTrainedModel):
    def __init__(self, config: BailingMoeConfig) -> None:
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BailingMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = BailingMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.word_embeddings = value  # type: ignore[assignment]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple[Any, ...]:
        past_key_values = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if past_key_values is not None and not isinstance(past_key_values, Cache):
            raise ValueError("past_key_values must be a transformers Cache (e.g. DynamicCache)")
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        b, s = x.shape[:2]
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                # Left padding: a sequence's first real token is position 0, as when it runs alone.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
            else:
                position_ids = torch.arange(past, past + s, device=x.device).expand(b, s)
        _, _, head_dim, theta = _shape(self.config)
        rope = _rope(position_ids, head_dim, theta, x.dtype)
        mask = _attention_mask(attention_mask, past, s, x.device)
        hidden: list[torch.Tensor] = []
        for layer in self.layers:
            if output_hidden_states:
                hidden.append(x)
            x = layer(x, rope, mask, past_key_values)
        x = self.norm(x)
        if output_hidden_states:
            hidden.append(x)
        cache = past_key_values if use_cache else None
        states = tuple(hidden) if output_hidden_states else None
        if return_dict is False:
            return tuple(v for v in (x, cache, states) if v is not None)
        fields: dict[str, Any] = {_CACHE_FIELD: cache}
        return BaseModelOutputWithPast(last_hidden_state=x, hidden_states=states, **fields)


class BailingMoeForCausalLM(BailingMoePreTrainedModel, GenerationMixin):
    # transformers 5 names a tied pair as target -> source; transformers 4 lists the tied names.
    _tied_weights_keys: Any = (
        {"lm_head.weight": "model.word_embeddings.weight"} if _TRANSFORMERS_MAJOR >= 5 else ["lm_head.weight"]
    )

    def __init__(self, config: BailingMoeConfig) -> None:
        super().__init__(config)
        self.model = BailingMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._head_cache: tuple[tuple[int, int, torch.dtype], torch.Tensor] | None = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.word_embeddings = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def head_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The LM head as used. NormHead divides each hidden column by its L2 norm over the vocabulary
        (+1e-7) in float32, with the norm detached as in Ling's training; at inference the result is kept
        until the weight changes."""
        w = self.lm_head.weight
        if not self.config.norm_head:
            return w.to(dtype)
        key = (w.data_ptr(), w._version, dtype)
        if not self.training and self._head_cache is not None and self._head_cache[0] == key:
            return self._head_cache[1]
        w32 = w.to(torch.float32)
        head = (w32 / (torch.linalg.vector_norm(w32, ord=2, dim=0, keepdim=True) + NORM_HEAD_EPS).detach()).to(dtype)
        if not self.training:
            self._head_cache = (key, head.detach())
        return head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple[Any, ...]:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        keep = logits_to_keep or kwargs.get("num_logits_to_keep") or 0  # the transformers 4.4x name
        hidden = out.last_hidden_state if not keep else out.last_hidden_state[:, -keep:]
        kv = getattr(out, _CACHE_FIELD)
        logits = F.linear(hidden, self.head_weight(hidden.dtype))
        loss = None
        if labels is not None:  # next-token cross-entropy, -100 ignored
            shifted = logits[:, :-1].to(torch.float32).reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        if return_dict is False:
            rest = (logits, kv, out.hidden_states)
            return tuple(v for v in ((loss,) if loss is not None else ()) + rest if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states, **{_CACHE_FIELD: kv})
