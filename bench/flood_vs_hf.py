"""lingctl flood vs Hugging Face transformers: offline batch generation on one CPU thread.

Both sides run the same function with the same weights. A tiny Ling MoE (4 layers, hidden 256, 64 experts
top-6, two shared experts, NormHead) is built with seeded random weights and copied exactly into HF's
``Qwen2MoeForCausalLM`` (transformers 5 has no ``bailing_moe``; Qwen2-MoE has the same softmax top-k
router with renormalisation and a shared expert, whose sigmoid gate is zeroed so it scales by 0.5, undone
by doubling its ``down_proj``). A dense Ling model (every layer ``first_k_dense_replace``) is copied into
``LlamaForCausalLM``. One forward of both on a random batch checks the copy (max |logit difference|), and
the greedy outputs of the two engines are compared token by token.

Workloads (greedy, no EOS: every request runs to its own length):

A. 64 prompts of 48-80 random tokens, 64 new tokens each: HF ``generate`` at batch size 1 (one request after
   the other), HF ``generate`` on one left-padded batch of 64, and flood with all 64 requests at once.
B. mixed: 64 requests sharing a 64-token system prompt followed by 16-48 own tokens, output lengths drawn
   log-uniformly from 1..512. HF runs a padded batch to its longest output (and is credited only with the
   requested tokens): once as one batch of 64 and once in sub-batches of 16 sorted by length (its best
   effort); flood runs each request to its own length and prefills the shared prompt once.
C. flood at batch size 1: decode tokens/s of one request (64-token prompt, 64 new tokens) against the
   memory-bandwidth ceiling, i.e. the bytes one decode step reads (active weights + KV cache) divided into
   a bandwidth measured here (``torch.sum`` over a 1 GiB float32 tensor on one thread).

Every side runs in this process, one after the other, with ``torch.set_num_threads(1)``; each is warmed up
once on a tiny input first. Ratios are flood / HF in tokens/s: above 1 means flood is faster.

    .venv/bin/python bench/flood_vs_hf.py [--quick] [--json] [--skip-dense-mixed]

HF runs with its defaults for this model: SDPA attention and, for the MoE, its ``grouped_mm`` experts
implementation (on this CPU faster than ``eager``; ``batched_mm`` is far slower); ``--hf-experts`` picks
another. Greedy outputs are compared to check that both sides compute the same thing.

A full run takes about 3 minutes on 2 cores; ``--quick`` (32 requests, shorter outputs, HF at batch size 1
timed on 4 requests and extrapolated, no dense mixed workload) under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

import lingctl
from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest
from lingctl.flood.engine.sampling import SamplingParams
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel

GiB = 1 << 30
SEED = 0
# Goals from the flood spec; printed as met / not met, never asserted.
GOAL_BATCH = 1.5  # flood / HF padded batch, MoE model, workload A
GOAL_MIXED = 2.0  # flood / HF padded batch, mixed workload B
GOAL_BS1 = 0.80  # flood batch-size-1 decode / memory-bandwidth ceiling


# -- models -------------------------------------------------------------------------------------------------


def ling_config(kind: str, dense_width: int) -> LingConfig:
    """The tiny Ling MoE (Ling-lite's routing at hidden 256), or the same shapes with every layer dense."""
    common: dict[str, Any] = dict(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=6,
        num_shared_experts=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=0,
        torch_dtype="float32",
    )
    if kind == "moe":
        return LingConfig(**common, intermediate_size=dense_width, first_k_dense_replace=0, norm_head=True)
    return LingConfig(**common, intermediate_size=dense_width, first_k_dense_replace=4, norm_head=False)


def build_ling(config: LingConfig) -> LingForCausalLM:
    model = LingForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(SEED))
    model.eval()
    model.normalize_head_()  # the head HF gets is the NormHead-normalised weight
    return model


def build_hf(ling: LingForCausalLM, kind: str, experts_impl: str | None) -> PreTrainedModel:
    """The HF model computing the same function, with every weight copied from ``ling``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    c = ling.config
    common: dict[str, Any] = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attention_dropout=0.0,
    )
    h, kv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    sd = ling.state_dict()
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": sd["model.word_embeddings.weight"],
        "model.norm.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    cfg: PreTrainedConfig
    cls: type[PreTrainedModel]
    if kind == "moe":
        # Qwen2-MoE's qkv_bias flag lets its attention match Ling's bias-free projections exactly.
        cfg = Qwen2MoeConfig(
            **common,
            intermediate_size=c.intermediate_size,
            moe_intermediate_size=c.moe_intermediate_size,
            shared_expert_intermediate_size=c.moe_intermediate_size * c.num_shared_experts,
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=1,
            qkv_bias=c.use_qkv_bias,
            use_sliding_window=False,
            output_router_logits=False,
        )
        cls = Qwen2MoeForCausalLM
    else:
        cfg = LlamaConfig(**common, intermediate_size=c.intermediate_size, attention_bias=False, mlp_bias=False)
        cls = LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    if experts_impl is not None:
        cfg._experts_implementation = experts_impl
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"]
        # Ling's fused projection is laid out [all Q heads | all K heads | all V heads].
        for suffix in ("weight", "bias") if c.use_qkv_bias else ("weight",):
            q, k, v = sd[src + f"attention.query_key_value.{suffix}"].split([h * dh, kv * dh, kv * dh])
            out[dst + f"self_attn.q_proj.{suffix}"] = q
            out[dst + f"self_attn.k_proj.{suffix}"] = k
            out[dst + f"self_attn.v_proj.{suffix}"] = v
        out[dst + "self_attn.o_proj.weight"] = sd[src + "attention.dense.weight"]
        if c.use_bias:
            raise ValueError("HF's o_proj has no bias: build the Ling model with use_bias=False")
        if kind == "moe":
            e = c.num_experts
            out[dst + "mlp.gate.weight"] = sd[src + "mlp.gate.weight"]
            gate = torch.stack([sd[src + f"mlp.experts.{j}.gate_proj.weight"] for j in range(e)])
            up = torch.stack([sd[src + f"mlp.experts.{j}.up_proj.weight"] for j in range(e)])
            out[dst + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, D]: [gate; up]
            out[dst + "mlp.experts.down_proj"] = torch.stack(
                [sd[src + f"mlp.experts.{j}.down_proj.weight"] for j in range(e)]
            )
            for p in ("gate_proj", "up_proj"):
                out[dst + f"mlp.shared_expert.{p}.weight"] = sd[src + f"mlp.shared_experts.{p}.weight"]
            # sigmoid(0) = 0.5 scales Qwen's shared expert; Ling's has no gate: double down_proj (exact in
            # floating point) so both compute the same sum.
            out[dst + "mlp.shared_expert.down_proj.weight"] = 2.0 * sd[src + "mlp.shared_experts.down_proj.weight"]
            out[dst + "mlp.shared_expert_gate.weight"] = torch.zeros(1, c.hidden_size)
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[dst + f"mlp.{p}.weight"] = sd[src + f"mlp.{p}.weight"]
    hf = cast("type[PreTrainedModel]", cls)(cfg)  # cfg is the config class that goes with cls
    hf.load_state_dict({k: v.clone() for k, v in out.items()}, strict=True)
    hf.eval()
    gen = hf.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = None, 0, None
    gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None
    return hf


@torch.inference_mode()
def logit_diff(ling: LingForCausalLM, hf: PreTrainedModel, vocab: int) -> float:
    ids = torch.randint(0, vocab, (4, 96), generator=torch.Generator().manual_seed(SEED + 1))
    a = ling(ids).logits
    b = hf(input_ids=ids).logits
    return float((a - b).abs().max())


# -- workloads ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_new: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_new)


def workload_a(vocab: int, n: int, new: int) -> Workload:
    rng = random.Random(SEED + 2)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(48, 80))] for _ in range(n)]
    return Workload("A", prompts, [new] * n)


def workload_b(vocab: int, n: int, max_out: int) -> Workload:
    rng = random.Random(SEED + 3)
    system = [rng.randrange(1, vocab) for _ in range(64)]
    prompts = [system + [rng.randrange(1, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]
    # log-uniform over 1..max_out: many short answers, a few long ones
    lengths = [min(max_out, int(math.exp(rng.uniform(0.0, math.log(max_out + 1))))) for _ in range(n)]
    return Workload("B", prompts, [max(1, x) for x in lengths])


# -- the two sides ----------------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_batch(hf: PreTrainedModel, prompts: list[list[int]], new: int) -> list[list[int]]:
    """One left-padded ``generate`` call; every row runs ``new`` tokens (no EOS)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = cast("GenerationMixin", hf).generate(  # both HF classes built here are GenerationMixins
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, width:].tolist()


def run_hf(hf: PreTrainedModel, w: Workload, batch: int, *, sort: bool = False, subsample: int | None = None) -> dict:
    """Requests in batches of ``batch`` (in order, or sorted by output length), each batch run to its
    longest output and cut to each request's own length. ``subsample``: time only that many requests
    (batch size 1) and extrapolate to all."""
    order = list(range(len(w.prompts)))
    if sort:
        order.sort(key=lambda i: w.max_new[i])
    if subsample is not None:
        order = order[:subsample]
    outputs: dict[int, list[int]] = {}
    computed = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch):
        group = order[b : b + batch]
        new = max(w.max_new[i] for i in group)
        rows = hf_batch(hf, [w.prompts[i] for i in group], new)
        computed += new * len(group)
        for i, row in zip(group, rows):
            outputs[i] = row[: w.max_new[i]]
    seconds = time.perf_counter() - start
    useful = sum(w.max_new[i] for i in order)
    res = {
        "seconds": seconds,
        "useful_tokens": useful,
        "computed_tokens": computed,
        "tokens_per_s": useful / seconds,
        "outputs": outputs,
    }
    if subsample is not None:
        res["extrapolated_from"] = len(order)
        res["seconds"] = seconds * w.useful_tokens / useful
        res["useful_tokens"] = w.useful_tokens
    return res


def flood_engine(model: LingForCausalLM, kv_tokens: int) -> Engine:
    return Engine.local(model, EngineConfig(kv_cache_tokens=kv_tokens, max_batch_tokens=1024, max_seqs=256))


def run_flood(model: LingForCausalLM, w: Workload, *, prefix_sharing: bool = True) -> dict:
    kv = sum(len(p) + n for p, n in zip(w.prompts, w.max_new)) + 1024
    engine = flood_engine(model, kv)
    engine.config.prefix_sharing = prefix_sharing
    reqs = [
        GenRequest(key=i, prompt_ids=p, sampling=SamplingParams(max_tokens=n, temperature=0.0))
        for i, (p, n) in enumerate(zip(w.prompts, w.max_new))
    ]
    outputs: dict[int, list[int]] = {}
    start = time.perf_counter()
    for res in engine.generate(reqs):
        if res.finish_reason != "length":
            raise RuntimeError(f"flood request {res.key} ended with {res.finish_reason}: {res.error}")
        outputs[res.key] = res.token_ids
    seconds = time.perf_counter() - start
    st = engine.stats
    return {
        "seconds": seconds,
        "useful_tokens": st.generated_tokens,
        "tokens_per_s": st.generated_tokens / seconds,
        "steps": st.scheduler.steps,
        "prefill_tokens": st.scheduler.prefill_tokens,
        "prefix_tokens_saved": st.prefix_tokens_saved,
        "outputs": outputs,
    }


def agreement(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict:
    """Identical sequences, and the share of tokens before each sequence's first difference (after one
    differing token the two continue from different contexts, so later positions say nothing)."""
    keys = sorted(set(a) & set(b))
    same = sum(a[k] == b[k] for k in keys)
    agreed = total = 0
    for k in keys:
        n = next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
        agreed += n
        total += len(a[k])
    return {"sequences": len(keys), "identical": same, "prefix_agreement": agreed / max(1, total)}


def warm_up(ling: LingForCausalLM, hf: PreTrainedModel) -> None:
    tiny = Workload("warm-up", [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]], [4, 4])
    run_hf(hf, tiny, 1)
    run_hf(hf, tiny, 2)
    run_flood(ling, tiny)


# -- batch-size-1 decode and the bandwidth ceiling ---------------------------------------------------------------


def measure_bandwidth(size_bytes: int, repeats: int = 5) -> dict:
    """Read bandwidth of one thread: the best of ``repeats`` sums over a float32 tensor far larger than the
    caches; a copy (read + write) for reference."""
    x = torch.ones(size_bytes // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    y = torch.empty_like(x)
    best_copy = min(_timed(lambda: y.copy_(x)) for _ in range(max(2, repeats // 2)))
    return {"bytes": size_bytes, "read_gb_s": size_bytes / best / 1e9, "copy_gb_s": 2 * size_bytes / best_copy / 1e9}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_bytes(c: LingConfig, kind: str, context: float) -> dict:
    """Bytes one decode token reads (float32): the weights it uses and its KV cache at ``context`` tokens."""
    d = c.hidden_size
    attn = d * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim + c.num_attention_heads * c.head_dim * d
    if kind == "moe":
        mlp = (c.num_experts_per_tok + c.num_shared_experts) * 3 * d * c.moe_intermediate_size + c.num_experts * d
    else:
        mlp = 3 * d * c.intermediate_size
    per_layer = attn + mlp + 2 * d
    weights = 4 * (c.num_hidden_layers * per_layer + d + d + c.vocab_size * d)  # + final norm, embedding row, head
    kv = 4 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context
    return {"weights": weights, "kv": int(kv), "total": int(weights + kv)}


def flood_bs1(model: LingForCausalLM, prompt: list[int], new: int) -> dict:
    """Decode tokens/s of one request: the time from the end of its prefill step to its last token."""
    engine = flood_engine(model, len(prompt) + new + 64)
    stamps: list[float] = []
    req = GenRequest(key=0, prompt_ids=prompt, sampling=SamplingParams(max_tokens=new, temperature=0.0))
    start = time.perf_counter()
    out = list(engine.generate([req], on_step=lambda _: stamps.append(time.perf_counter())))
    end = time.perf_counter()
    decode_steps = len(stamps) - 1
    return {
        "tokens": len(out[0].token_ids),
        "seconds": end - start,
        "steps": len(stamps),
        "decode_tokens_per_s": decode_steps / (stamps[-1] - stamps[0]),
        "prefill_seconds": stamps[0] - start,
    }


def hf_bs1_decode(hf: PreTrainedModel, prompt: list[int], new: int) -> float:
    """HF's decode tokens/s at batch size 1 for reference: (new - 1) tokens over the time past a 1-token run."""
    one = _timed(lambda: hf_batch(hf, [prompt], 1))
    full = _timed(lambda: hf_batch(hf, [prompt], new))
    return (new - 1) / max(1e-9, full - one)


# -- the run ------------------------------------------------------------------------------------------------------


def versions() -> dict:
    import transformers

    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "lingctl": lingctl.__version__,
        "lingctl_commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def _public(res: dict) -> dict:
    out = {k: v for k, v in res.items() if k != "outputs"}
    for k in ("seconds", "tokens_per_s"):
        if k in out:
            out[k] = round(out[k], 2 if k == "seconds" else 1)
    return out


def bench_model(kind: str, args: argparse.Namespace, log) -> dict:
    config = ling_config(kind, args.dense_width)
    ling = build_ling(config)
    hf = build_hf(ling, kind, args.hf_experts)
    res: dict = {
        "model": {
            "kind": kind,
            "peer": type(hf).__name__,
            "parameters": sum(p.numel() for p in ling.parameters()),
            "active_parameters": config.num_parameters(active=True) if kind == "moe" else None,
            "hf_experts": getattr(hf.config, "_experts_implementation", None) if kind == "moe" else None,
            "hf_attention": hf.config._attn_implementation,
        }
    }
    res["max_logit_diff"] = logit_diff(ling, hf, config.vocab_size)
    log(
        f"{kind}: {res['model']['parameters'] / 1e6:.1f}M parameters; HF {res['model']['peer']}; "
        f"max |logit diff| {res['max_logit_diff']:.2e}"
    )
    warm_up(ling, hf)

    a = workload_a(config.vocab_size, args.requests, args.new_tokens)
    hf_pad = fl = None
    for _ in range(args.rounds):  # alternate the sides, keep each one's fastest round
        r = run_hf(hf, a, len(a.prompts))
        hf_pad = r if hf_pad is None or r["seconds"] < hf_pad["seconds"] else hf_pad
        log(f"  A  HF padded batch   {r['seconds']:7.2f} s  {r['tokens_per_s']:8.1f} tok/s")
        r = run_flood(ling, a)
        fl = r if fl is None or r["seconds"] < fl["seconds"] else fl
        log(f"  A  flood             {r['seconds']:7.2f} s  {r['tokens_per_s']:8.1f} tok/s")
    hf_one = run_hf(hf, a, 1, subsample=args.bs1_sample)
    log(
        f"  A  HF batch size 1   {hf_one['seconds']:7.2f} s  {hf_one['tokens_per_s']:8.1f} tok/s"
        + (f"  (timed on {args.bs1_sample} requests, extrapolated)" if args.bs1_sample else "")
    )
    assert hf_pad is not None and fl is not None  # args.rounds >= 1
    res["A"] = {
        "requests": len(a.prompts),
        "new_tokens": args.new_tokens,
        "useful_tokens": a.useful_tokens,
        "hf_bs1": _public(hf_one),
        "hf_padded": _public(hf_pad),
        "flood": _public(fl),
        "flood_vs_hf_padded": ratio(fl["tokens_per_s"], hf_pad["tokens_per_s"]),
        "flood_vs_hf_bs1": ratio(fl["tokens_per_s"], hf_one["useful_tokens"] / hf_one["seconds"]),
        "agreement_vs_hf_padded": agreement(fl["outputs"], hf_pad["outputs"]),
        "agreement_vs_hf_bs1": agreement(fl["outputs"], hf_one["outputs"]),
    }

    if kind == "moe" or not args.skip_dense_mixed:
        b = workload_b(config.vocab_size, args.requests, args.max_out)
        runs = {}
        if not args.skip_plain_mixed:
            runs["hf_padded"] = run_hf(hf, b, len(b.prompts))
            log(
                f"  B  HF padded batch   {runs['hf_padded']['seconds']:7.2f} s  "
                f"{runs['hf_padded']['tokens_per_s']:8.1f} useful tok/s"
            )
        runs["hf_sorted"] = run_hf(hf, b, args.sub_batch, sort=True)
        log(
            f"  B  HF sorted x{args.sub_batch:<3d}    {runs['hf_sorted']['seconds']:7.2f} s  "
            f"{runs['hf_sorted']['tokens_per_s']:8.1f} useful tok/s"
        )
        runs["flood"] = run_flood(ling, b)
        log(
            f"  B  flood             {runs['flood']['seconds']:7.2f} s  "
            f"{runs['flood']['tokens_per_s']:8.1f} useful tok/s"
        )
        res["B"] = {
            "requests": len(b.prompts),
            "useful_tokens": b.useful_tokens,
            "max_out": args.max_out,
            "output_lengths": f"log-uniform 1..{args.max_out}",
            "sub_batch": args.sub_batch,
            **{k: _public(v) for k, v in runs.items()},
            "agreement_vs_hf_sorted": agreement(runs["flood"]["outputs"], runs["hf_sorted"]["outputs"]),
        }
        for k in ("hf_padded", "hf_sorted"):
            if k in runs:
                res["B"][f"flood_vs_{k}"] = ratio(runs["flood"]["tokens_per_s"], runs[k]["tokens_per_s"])

    prompt = workload_a(config.vocab_size, 1, 0).prompts[0]
    prompt = (prompt * 2)[:64]
    one = max((flood_bs1(ling, prompt, 64) for _ in range(args.rounds)), key=lambda r: r["decode_tokens_per_s"])
    need = decode_bytes(config, kind, context=64 + 64 / 2)
    ceiling = args.bandwidth["read_gb_s"] * 1e9 / need["total"]
    res["C"] = {
        "flood": {k: round(v, 3) if isinstance(v, float) else v for k, v in one.items()},
        "hf_decode_tokens_per_s": round(hf_bs1_decode(hf, prompt, 64), 1),
        "bytes_per_token": need,
        "ceiling_tokens_per_s": round(ceiling, 1),
        "of_ceiling": round(one["decode_tokens_per_s"] / ceiling, 3),
    }
    log(
        f"  C  flood bs=1 decode {one['decode_tokens_per_s']:8.1f} tok/s; ceiling {ceiling:,.0f} tok/s "
        f"({need['total'] / 1e6:.1f} MB per token)"
    )
    return res


def bench(args: argparse.Namespace, log) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    res: dict = {"versions": versions()}
    res["settings"] = {
        "quick": args.quick,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "max_out": args.max_out,
        "sub_batch": args.sub_batch,
        "bs1_sample": args.bs1_sample,
        "rounds": args.rounds,
        "dense_width": args.dense_width,
        "dtype": "float32",
        "flood": {"max_batch_tokens": 1024, "max_seqs": 256, "chunk": 16},
    }
    args.bandwidth = measure_bandwidth(args.bandwidth_mib << 20)
    res["bandwidth"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in args.bandwidth.items()}
    log(
        f"memory bandwidth (one thread): read {args.bandwidth['read_gb_s']:.1f} GB/s, "
        f"copy {args.bandwidth['copy_gb_s']:.1f} GB/s"
    )
    started = time.perf_counter()
    res["moe"] = bench_model("moe", args, log)
    if not args.skip_dense:
        res["dense"] = bench_model("dense", args, log)
    res["seconds"] = round(time.perf_counter() - started, 1)
    moe = res["moe"]
    res["goals"] = {
        "batch_vs_hf_padded": {"goal": GOAL_BATCH, "value": moe["A"]["flood_vs_hf_padded"]},
        "mixed_vs_hf_padded": {"goal": GOAL_MIXED, "value": moe["B"].get("flood_vs_hf_padded")},
        "mixed_vs_hf_sorted": {"goal": GOAL_MIXED, "value": moe["B"]["flood_vs_hf_sorted"]},
        "bs1_of_ceiling": {"goal": GOAL_BS1, "value": moe["C"]["of_ceiling"]},
    }
    for g in res["goals"].values():
        g["met"] = None if g["value"] is None else g["value"] >= g["goal"]
    return res


def _met(g: dict) -> str:
    return "-" if g["met"] is None else ("met" if g["met"] else "NOT met")


def print_table(res: dict) -> None:
    v, bw = res["versions"], res["bandwidth"]
    print()
    print(
        f"lingctl {v['lingctl']} ({v['lingctl_commit']}) flood vs transformers {v['transformers']}; "
        f"torch {v['torch']}, Python {v['python']}"
    )
    print(
        f"CPU {v['cpu']} ({v['cores']} cores), {v['threads']} compute thread; float32; "
        f"one-thread bandwidth: read {bw['read_gb_s']} GB/s, copy {bw['copy_gb_s']} GB/s"
    )
    print("flood: max_batch_tokens 1024, max_seqs 256, chunk 16; HF: generate(), greedy, no EOS, SDPA attention")
    for kind in ("moe", "dense"):
        if kind not in res:
            continue
        r = res[kind]
        m = r["model"]
        extra = f", {m['active_parameters'] / 1e6:.1f}M active, HF experts '{m['hf_experts']}'" if kind == "moe" else ""
        print(
            f"\n== {kind}: {m['parameters'] / 1e6:.1f}M parameters{extra}; peer {m['peer']}; "
            f"max |logit diff| {r['max_logit_diff']:.1e}"
        )
        head = f"{'measurement':56s} {'seconds':>8s} {'tok/s':>9s} {'flood x':>8s}"
        print(head)
        print("-" * len(head))
        a = r["A"]
        fl = a["flood"]["tokens_per_s"]
        one = a["hf_bs1"]
        note = f" (extrapolated from {one['extrapolated_from']})" if "extrapolated_from" in one else ""
        rows = [
            (f"A HF generate, batch size 1{note}", one["seconds"], one["useful_tokens"] / one["seconds"]),
            (
                f"A HF generate, one padded batch of {a['requests']}",
                a["hf_padded"]["seconds"],
                a["hf_padded"]["tokens_per_s"],
            ),
            (f"A flood, {a['requests']} requests at once", a["flood"]["seconds"], fl),
        ]
        for name, sec, tps in rows:
            print(f"{name:56s} {sec:8.2f} {tps:9.1f} {fl / tps:8.2f}")
        ag, ag1 = a["agreement_vs_hf_padded"], a["agreement_vs_hf_bs1"]
        print(
            f"  greedy agreement flood vs HF padded: {ag['identical']}/{ag['sequences']} identical, "
            f"{100 * ag['prefix_agreement']:.1f}% of tokens before a first difference; vs HF bs=1: "
            f"{ag1['identical']}/{ag1['sequences']}, {100 * ag1['prefix_agreement']:.1f}%"
        )
        if "B" in r:
            b = r["B"]
            fl = b["flood"]["tokens_per_s"]
            print(
                f"B mixed: {b['requests']} requests, 64-token shared system prompt + 16-48 own tokens, outputs "
                f"{b['output_lengths']} ({b['useful_tokens']:,} useful tokens)"
            )
            for key, name in (
                ("hf_padded", f"B HF one padded batch of {b['requests']}, run to the longest"),
                ("hf_sorted", f"B HF sorted by length, sub-batches of {b['sub_batch']}"),
                ("flood", "B flood, own lengths + prefix sharing"),
            ):
                if key in b:
                    x = b[key]
                    comp = f" [{x['computed_tokens']:,} computed]" if "computed_tokens" in x else ""
                    print(
                        f"{name:56s} {x['seconds']:8.2f} {x['tokens_per_s']:9.1f} {fl / x['tokens_per_s']:8.2f}{comp}"
                    )
            ag = b["agreement_vs_hf_sorted"]
            print(
                f"  flood prefilled {b['flood']['prefill_tokens']:,} prompt tokens, "
                f"{b['flood']['prefix_tokens_saved']:,} saved by sharing; agreement vs HF sorted: "
                f"{ag['identical']}/{ag['sequences']} identical, "
                f"{100 * ag['prefix_agreement']:.1f}%"
            )
        c = r["C"]
        print(
            f"C flood batch size 1 decode (64-token prompt, 64 new): {c['flood']['decode_tokens_per_s']:.1f} tok/s "
            f"(HF generate bs=1: {c['hf_decode_tokens_per_s']:.1f}); reads "
            f"{c['bytes_per_token']['total'] / 1e6:.1f} MB "
            f"per token ({c['bytes_per_token']['weights'] / 1e6:.1f} MB weights) -> ceiling "
            f"{c['ceiling_tokens_per_s']:,.0f} tok/s; flood at {100 * c['of_ceiling']:.1f}% of it"
        )
    print(
        "\nThe active weights (~25 MB) partly fit in this CPU's caches, so the bandwidth ceiling is a DRAM bound "
        "only approximately."
    )
    print("\ngoals (MoE model):")
    names = {
        "batch_vs_hf_padded": "A: flood >= 1.5x HF padded batch",
        "mixed_vs_hf_padded": "B: flood >= 2x HF padded batch (one batch)",
        "mixed_vs_hf_sorted": "B: flood >= 2x HF padded batch (sorted sub-batches)",
        "bs1_of_ceiling": "C: bs=1 decode >= 80% of the bandwidth ceiling",
    }
    for key, g in res["goals"].items():
        print(f"  {names[key]:52s} {'-' if g['value'] is None else g['value']:>6}  {_met(g)}")
    print(f"\nbenchmark wall time {res['seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64, help="workload A: tokens generated per request")
    parser.add_argument("--max-out", type=int, default=512, help="workload B: longest output length")
    parser.add_argument("--sub-batch", type=int, default=16, help="workload B: HF's sorted sub-batch size")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="workload A batch sides and C: rounds, alternating the sides; the fastest counts",
    )
    parser.add_argument(
        "--bs1-sample", type=int, default=None, help="time HF at batch size 1 on this many requests and extrapolate"
    )
    parser.add_argument("--dense-width", type=int, default=1024, help="intermediate_size of the dense model")
    parser.add_argument("--hf-experts", default=None, help="HF experts implementation (default: its own choice)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--skip-dense-mixed", action="store_true")
    parser.add_argument("--skip-plain-mixed", action="store_true", help="workload B: only HF's sorted sub-batches")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.max_out = 32, 32, 128
        args.bs1_sample = args.bs1_sample or 4
        args.rounds = 1
        args.skip_dense_mixed = True
        args.bandwidth_mib = min(args.bandwidth_mib, 256)
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, flush=True))
    results = bench(args, log)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
