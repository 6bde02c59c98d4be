"""MoE dispatch for training: Ling's per-expert mask loop vs sorted dispatch vs grouped matmul.

Measures training tokens/s (forward + backward) of one Ling MoE layer at 64 experts top-6 with each
dispatch, in one process, interleaving the variants round by round so machine noise hits all alike, and
prints each variant's ratio to the naive loop. Also times a full training step of a small model so the
layer-level gain can be read against the whole step.

    .venv/bin/python bench/train_moe_dispatch.py [--tokens 4096] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch

from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.model.moe import Dispatch, SparseMoeBlock
from lingctl.model.presets import preset

VARIANTS: tuple[Dispatch, ...] = ("naive", "sorted", "grouped")


def layer_config(hidden: int, width: int) -> LingConfig:
    # Ling-lite's routing (64 experts, top-6, 2 shared) at a width that fits this machine.
    return dataclasses.replace(
        preset("ling-lite"),
        hidden_size=hidden,
        moe_intermediate_size=width,
        num_hidden_layers=1,
        vocab_size=1024,
        pad_token_id=0,
        eos_token_id=0,
    )


def time_layer(block: SparseMoeBlock, x: torch.Tensor, dispatch: Dispatch, dtype: torch.dtype, iters: int) -> float:
    block.dispatch = dispatch
    grad = torch.randn_like(x)
    start = time.perf_counter()
    for _ in range(iters):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y, _ = block(x)
        y.float().backward(grad)
        block.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / iters


def time_model(model: LingForCausalLM, ids: torch.Tensor, dispatch: Dispatch, iters: int) -> float:
    model.set_dispatch(dispatch)
    start = time.perf_counter()
    for _ in range(iters):
        out = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / iters


def bf16_is_native() -> bool:
    """Whether bf16 matmuls run in hardware here (AMX / AVX512-BF16); emulated ones take ~50x fp32."""
    a = torch.randn(512, 512)
    timings = []
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x
        start = time.perf_counter()
        for _ in range(3):
            x @ x
        timings.append(time.perf_counter() - start)
    return timings[1] < 2 * timings[0]


def bench(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    results: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "rounds": args.rounds,
    }
    cfg = layer_config(args.hidden, args.width)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, args.tokens, cfg.hidden_size, requires_grad=True)
    results["layer"] = {
        "experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok,
        "shared": cfg.num_shared_experts,
        "hidden": cfg.hidden_size,
        "width": cfg.moe_intermediate_size,
    }
    dtypes = [torch.float32]
    if bf16_is_native():
        dtypes.append(torch.bfloat16)
    else:
        results["layer_bfloat16"] = None  # emulated bf16 matmuls are orders of magnitude slower: not informative
    for dtype in dtypes:
        name = "float32" if dtype == torch.float32 else "bfloat16"
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for v in VARIANTS:
            time_layer(block, x, v, dtype, 1)  # warm-up
        for _ in range(args.rounds):
            for v in VARIANTS:
                times[v].append(time_layer(block, x, v, dtype, args.iters))
        results[f"layer_{name}"] = _summarise(times, args.tokens)

    small = dataclasses.replace(preset("small"), num_experts=64, num_experts_per_tok=6, moe_intermediate_size=64)
    model = LingForCausalLM(small)
    model.init_weights(torch.Generator().manual_seed(0))
    ids = torch.randint(0, small.vocab_size, (args.tokens // 256, 257))
    times = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        time_model(model, ids, v, 1)
    for _ in range(max(2, args.rounds // 2)):
        for v in VARIANTS:
            times[v].append(time_model(model, ids, v, 1))
    results["model_float32"] = _summarise(times, ids[:, :-1].numel())
    results["model"] = {
        "preset": "small",
        "num_experts": 64,
        "top_k": 6,
        "moe_intermediate_size": 64,
        "parameters": small.num_parameters(),
    }
    return results


def _summarise(times: dict[str, list[float]], tokens: int) -> dict:
    med = {v: statistics.median(t) for v, t in times.items()}
    return {
        v: {
            "tokens_per_s": round(tokens / med[v], 1),
            "ms": round(med[v] * 1e3, 2),
            "vs_naive": round(med["naive"] / med[v], 2),
        }
        for v in times
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = bench(args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"torch {results['torch']}, {results['threads']} threads, {args.tokens} tokens per step, "
        f"median of {args.rounds} interleaved rounds"
    )
    for key, title in (
        ("layer_float32", "MoE layer fwd+bwd, float32"),
        ("layer_bfloat16", "MoE layer fwd+bwd, bf16 autocast"),
        ("model_float32", "full training step, small preset at 64 experts top-6, float32"),
    ):
        print(f"\n{title}")
        if results[key] is None:
            print("  skipped: this CPU has no native bf16 matmul (no AMX / AVX512-BF16)")
            continue
        for v, r in results[key].items():
            print(f"  {v:8s} {r['tokens_per_s']:>10,.0f} tok/s  {r['ms']:>8.1f} ms  {r['vs_naive']:.2f}x naive")


if __name__ == "__main__":
    main()
