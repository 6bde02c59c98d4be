"""``BailingMoeForCausalLM``: the Ling MoE decoder, single-device and readable; parallelism is applied
from outside (DDP, local SGD, pipeline stages) so this file never changes for it.

Parameter names are exactly those of Ling checkpoints: ``model.word_embeddings.weight``,
``model.layers.{i}.input_layernorm.weight``, ``model.layers.{i}.attention.query_key_value.weight``,
``model.layers.{i}.attention.dense.weight``, ``model.layers.{i}.post_attention_layernorm.weight``,
``model.layers.{i}.mlp.gate.weight``, ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
``model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight`` (dense layers: ``mlp.{gate,up,down}_proj``),
``model.norm.weight`` and ``lm_head.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lingctl.model.config import LingConfig
from lingctl.model.layers import MLP, Attention, Blocks, RMSNorm
from lingctl.model.moe import Dispatch, Router, RouterOutput, SparseMoeBlock

NORM_HEAD_EPS = 1e-7


class DecoderLayer(nn.Module):
    def __init__(self, config: LingConfig, index: int, dispatch: Dispatch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: SparseMoeBlock | MLP
        if config.is_moe_layer(index):
            self.mlp = SparseMoeBlock(config, dispatch)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x_BSD: torch.Tensor, positions_BS: torch.Tensor, blocks: Blocks | None = None
    ) -> tuple[torch.Tensor, RouterOutput | None]:
        h = x_BSD + self.attention(self.input_layernorm(x_BSD), positions_BS, blocks)
        return self.mlp_residual(h)

    def mlp_residual(self, h_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterOutput | None]:
        out = self.mlp(self.post_attention_layernorm(h_BSD))
        if isinstance(out, tuple):
            return h_BSD + out[0], out[1]
        return h_BSD + out, None


class LingModel(nn.Module):
    """``model``: embeddings, decoder layers, final norm."""

    def __init__(self, config: LingConfig, dispatch: Dispatch = "sorted") -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dispatch) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass(slots=True)
class CausalLMOutput:
    logits: torch.Tensor  # [B, S, vocab], or [N, vocab] at the positions asked for
    routes: list[RouterOutput]  # one per MoE layer, in layer order


class LingForCausalLM(nn.Module):
    def __init__(self, config: LingConfig, dispatch: Dispatch = "sorted") -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = LingModel(config, dispatch)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight

    # -- structure --------------------------------------------------------------------------------
    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def set_dispatch(self, dispatch: Dispatch) -> None:
        for block in self.moe_blocks():
            block.dispatch = dispatch

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, initializer_range) for every matrix (router included), ones for norms, zero biases."""
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=generator)

    # -- forward ------------------------------------------------------------------------------------
    def head_weight(self) -> torch.Tensor:
        """The LM head matrix as used. NormHead divides each hidden column by its L2 norm across the
        vocabulary (dim 0) + 1e-7, in float32; the norm is detached as in Ling's training code, so the
        gradient flows through the direction only."""
        w = self.lm_head.weight
        if not self.config.norm_head:
            return w
        w32 = w.to(torch.float32)
        norm = torch.linalg.vector_norm(w32, ord=2, dim=0, keepdim=True) + NORM_HEAD_EPS
        return w32 / norm.detach()

    def logits(self, hidden_BSD: torch.Tensor) -> torch.Tensor:
        w = self.head_weight()
        if not torch.is_autocast_enabled(hidden_BSD.device.type):
            w = w.to(hidden_BSD.dtype)  # NormHead computes in float32; a bf16 model multiplies in bf16
        return F.linear(hidden_BSD, w)

    def hidden_states(
        self,
        input_ids_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        blocks: Blocks | None = None,
    ) -> tuple[torch.Tensor, list[RouterOutput]]:
        """``blocks``: packed rows whose examples attend only within themselves (fine-tuning), with
        ``positions_BS`` restarting per example; None: each row is one causal sequence."""
        if positions_BS is None:
            s = input_ids_BS.shape[1]
            positions_BS = torch.arange(s, device=input_ids_BS.device).expand_as(input_ids_BS)
        x = self.model.word_embeddings(input_ids_BS)
        routes: list[RouterOutput] = []
        for layer in self.model.layers:
            x, route = layer(x, positions_BS, blocks)
            if route is not None:
                routes.append(route)
        return self.model.norm(x), routes

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        positions_BS: torch.Tensor | None = None,
        blocks: Blocks | None = None,
        logits_at_N: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """``logits_at_N``: flat token indices (into B*S) to compute logits at, [N, vocab]; fine-tuning takes
        its loss on answer tokens only, and the head is the largest matrix product of a small model."""
        hidden, routes = self.hidden_states(input_ids_BS, positions_BS, blocks)
        if logits_at_N is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1])[logits_at_N]
        return CausalLMOutput(self.logits(hidden), routes)

    def normalize_head_(self) -> None:
        """Bake NormHead into ``lm_head.weight`` for inference (what Ling does on its first eval forward),
        so the division is not repeated per token; afterwards ``norm_head`` is off for this instance."""
        if not self.config.norm_head:
            return
        with torch.no_grad():
            w = self.head_weight().to(self.lm_head.weight.dtype)
            self.lm_head.weight.copy_(w)
        self.config.norm_head = False
