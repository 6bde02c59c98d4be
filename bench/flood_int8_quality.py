"""How close flood's int8 models stay to the float32 model: greedy top-1 agreement and next-token KL divergence.

    python bench/flood_int8_quality.py CKPT [CKPT ...] [--prompts 64] [--length 48] [--json]

For each checkpoint directory (a Ling checkpoint, e.g. from bench/ling_lite_checkpoint.py --layers 2, or one that
lingctl train wrote), the model is loaded three times the way ``lingctl flood run`` loads it, with float32
activations: float32 weights (the reference), ``--quantize int8`` (int8 weights, float32 activations) and
``--quantize w8a8`` (int8 weights, each token's activations quantized to int8 as well). Each runs the same random
prompts of token ids teacher-forced (one forward over every position); the figures compare every position's
next-token distribution with the reference's:

- top-1 agreement: the share of positions whose most likely token is the reference's;
- KL: mean KL(reference || quantized) in nats, and its 99th percentile.

Random-valued checkpoints have flat distributions where the top-1 token is often a near tie, so their agreement
is a lower bound of what a trained model shows. Asserts nothing; prints a table (or JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lingctl.flood.weights.model_dir import ModelDir

VARIANTS = ("int8", "w8a8")


def log_probs(model: torch.nn.Module, prompts: torch.Tensor, batch: int) -> torch.Tensor:
    """[P, S, V] float32 log-probabilities of every position's next token."""
    out = []
    with torch.no_grad():
        for i in range(0, prompts.shape[0], batch):
            logits = model(prompts[i : i + batch]).logits.float()
            out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    kl = (ref.exp() * (ref - got)).sum(-1).flatten()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    return {
        "top1_agreement": round(float(agree), 4),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl.double(), 0.99)),
    }


def measure(ckpt: Path, prompts: int, length: int, batch: int, seed: int) -> dict:
    md = ModelDir.open(ckpt)
    vocab = md.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (prompts, length), generator=g)
    row: dict = {"checkpoint": str(ckpt), "layers": md.config.num_hidden_layers, "hidden": md.config.hidden_size}
    t0 = time.perf_counter()
    ref = log_probs(md.load(dtype=torch.float32).eval(), ids, batch)
    row["float32_s"] = round(time.perf_counter() - t0, 1)
    for variant in VARIANTS:
        t0 = time.perf_counter()
        got = log_probs(md.load(dtype=torch.float32, quantize=variant).eval(), ids, batch)
        row[variant] = {**compare(ref, got), "seconds": round(time.perf_counter() - t0, 1)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(c, args.prompts, args.length, args.batch, args.seed) for c in args.checkpoints]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.prompts} prompts x {args.length} positions, teacher-forced, against float32 weights")
    print("| checkpoint | variant | top-1 agreement | mean KL (nats) | p99 KL |")
    print("|---|---|---|---|---|")
    for r in rows:
        for v in VARIANTS:
            m = r[v]
            name = f"{Path(r['checkpoint']).name} ({r['layers']} layers, hidden {r['hidden']})"
            print(f"| {name} | {v} | {m['top1_agreement']:.4f} | {m['kl_mean']:.2e} | {m['kl_p99']:.2e} |")


if __name__ == "__main__":
    main()
