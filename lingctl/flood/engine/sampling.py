"""Per-request sampling: greedy, temperature, top-k, top-p and min-p, repetition, frequency and presence
penalties, with a generator owned by the request so its tokens never depend on which other requests share the
batch.

The order is vLLM's (its v1 sampler): tokens that may not come yet are masked (``min_tokens``), then the penalties
change the raw logits (so they change greedy answers too), then a greedy request takes the first maximum;
otherwise temperature, min-p, top-k, top-p, and a draw from the request's generator."""

from __future__ import annotations

from collections.abc import Sequence
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
    min_p: float = 0.0  # tokens less likely than min_p x the most likely one are dropped (0: off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate past the end-of-sequence token
    min_tokens: int = 0  # no end-of-sequence token and no stop string before this many new tokens
    repetition_penalty: float = 1.0  # > 1 discourages any token of the prompt or the output so far
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if the token is in the output
    logprobs: int | None = None  # return each new token's log-probability and this many top ones (None: not)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the penalties change the logits (then greedy is not the argmax of the raw logits)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


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


def sample(
    logits_V: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    blocked: Sequence[int] = (),
) -> int:
    """One token from one row of float32 logits, given the request's ``prompt`` and ``output`` token ids so
    far (for the penalties) and the ids that may not come yet (``blocked``). Greedy takes the first maximum;
    otherwise temperature, min-p, top-k, top-p (the smallest set of most likely tokens whose mass reaches p), then
    a draw from the request's generator."""
    import torch

    logits = logits_V.float()
    if blocked or params.penalised:
        logits = _penalised(logits.clone(), params, prompt, output)
        if blocked:
            logits[torch.tensor(sorted(set(blocked)), dtype=torch.long)] = float("-inf")
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def _penalised(
    logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """vLLM's penalties on raw logits: the repetition penalty divides a positive logit (multiplies a negative
    one) of every token seen in the prompt or the output; frequency and presence penalties subtract per
    occurrence in the output and once for being there. Ids past the logits (none from a real model) are
    ignored."""
    import torch

    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            values = logits[seen]
            p = params.repetition_penalty
            logits[seen] = torch.where(values > 0, values / p, values * p)
    if (params.frequency_penalty or params.presence_penalty) and output:
        ids = torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.long)
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
