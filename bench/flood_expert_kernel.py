"""flood's routed-expert kernel alone: how fast it streams the experts' weights, against reading the same bytes.

    .venv/bin/python bench/flood_expert_kernel.py [--tokens 64] [--threads 1] [--dtype float32|bfloat16] [--json]

Four layers of the tiny Ling MoE's experts (64 experts of width 128 at hidden 256, top-6: 25 MB per layer in
float32), seeded random weights and routing. A decode step of ``--tokens`` tokens routes about tokens x 6 / 64
rows to each expert, and every expert is read once per layer: at 64 tokens the kernel is bound by memory. The
peer is the floor for any kernel: ``torch.sum`` over the same weight tensors (a pure sequential read), in the same
process and thread count. Printed: ms for the four layers, the weight bytes over that time, and the ratio of the
two times. Best of ``--repeats``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lingctl.flood.engine.native import kernels, why_unavailable

LAYERS, EXPERTS, HIDDEN, WIDTH, TOP_K = 4, 64, 256, 128, 6


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    k = kernels()
    if k is None:
        sys.exit(f"flood's native kernels are unavailable here: {why_unavailable()}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    gate_up = [(torch.randn(EXPERTS, HIDDEN, 2 * WIDTH, generator=g) * 0.05).to(dtype) for _ in range(LAYERS)]
    down = [(torch.randn(EXPERTS, WIDTH, HIDDEN, generator=g) * 0.05).to(dtype) for _ in range(LAYERS)]
    x = torch.randn(args.tokens, HIDDEN, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(args.tokens)])
    w = torch.rand(args.tokens, TOP_K, generator=g)

    def experts() -> None:
        for layer in range(LAYERS):
            k.moe(x, idx, w, gate_up[layer], down[layer])

    def read() -> None:
        for layer in range(LAYERS):
            gate_up[layer].sum()
            down[layer].sum()

    experts()
    read()  # warm-up
    t_kernel, t_read = best_of(args.repeats, experts), best_of(args.repeats, read)
    gb = sum(t.numel() * t.element_size() for t in (*gate_up, *down)) / 1e9
    result = {
        "tokens": args.tokens,
        "threads": args.threads,
        "dtype": args.dtype,
        "weight_gb": gb,
        "kernel_ms": t_kernel * 1e3,
        "kernel_gb_per_s": gb / t_kernel,
        "read_ms": t_read * 1e3,
        "read_gb_per_s": gb / t_read,
        "kernel_over_read": t_kernel / t_read,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{LAYERS} layers of {EXPERTS} experts ({gb * 1e3:.0f} MB {args.dtype}), {args.tokens} tokens top-{TOP_K}, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    print(f"  expert kernel  {t_kernel * 1e3:7.2f} ms  {gb / t_kernel:5.1f} GB/s")
    print(f"  torch.sum      {t_read * 1e3:7.2f} ms  {gb / t_read:5.1f} GB/s")
    print(f"  kernel / read  {t_kernel / t_read:.2f}x the time")


if __name__ == "__main__":
    main()
