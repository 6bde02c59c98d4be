"""Per-request sampling: greedy, temperature, top-k, top-p, with a generator owned by the request so its
tokens never depend on which other requests share the batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """OpenAI request fields that shape generation. ``max_tokens=None`` means "until the context is full"
    (the chat API's default); completions default to 16 as OpenAI's do. ``top_k=0`` disables top-k."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def request_generator(seed: int | None, fallback_key: str) -> torch.Generator:
    """The request's own generator: its seed, or one derived from its key (custom_id) so an unseeded
    request is reproducible too, including across ``--resume``."""
    import hashlib

    import torch

    if seed is None:
        # surrogatepass: the same bytes as plain UTF-8 for any valid key, and no exception for one that is not.
        key = fallback_key.encode("utf-8", "surrogatepass")
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
    return torch.Generator().manual_seed(seed & ((1 << 63) - 1))


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row of float32 logits. Greedy takes the first maximum; otherwise temperature, then
    top-k, then top-p (the smallest set of most likely tokens whose mass reaches p), then a draw from the
    request's generator."""
    import torch

    if params.greedy:
        return int(torch.argmax(logits_V))
    scaled = logits_V.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep tokens whose preceding mass is below p: the most likely token always survives
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
        keep[0] = True  # even when top_p rounds to 0 in float32
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = probs.masked_fill(~mask, 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))
