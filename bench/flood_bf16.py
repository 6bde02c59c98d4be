"""flood's native bfloat16 expert kernel against torch's bf16 products, in the same process and run.

    .venv/bin/python bench/flood_bf16.py [--models tiny,ling-lite-2] [--threads 1] [--rounds 2] [--json]

Models, built in memory with seeded random values (nothing is downloaded):

- ``tiny``: the tiny Ling MoE of ``flood_vs_hf.py`` (4 layers, hidden 256, 64 experts top-6, width 128); 64 requests
  of 48-80 random ids, 64 greedy new tokens each.
- ``ling-lite-2``: two layers of Ling-lite's shapes (hidden 2048, 64 experts top-6 of width 1408, two shared
  experts, vocabulary 126,464); 8 requests of 64 random ids, 16 new tokens each.

Each model runs through ``Engine.local`` with ``--dtype bfloat16`` semantics (weights and activations bf16) twice
per round: ``native`` (the routed experts in flood's bf16 kernel) and ``torch`` (the same engine with the native
kernels switched off: torch's bf16 products, grouped or one per expert, padded to 4 rows). Attention and the dense
layers run on torch in both, so the difference is the experts alone. The rounds alternate the sides; the fastest
counts. Printed: prompt tokens/s (steps with prompt tokens), decode tokens/s (decode-only steps), the total, and how
close each side's greedy tokens stay to a float32 run of the same model (the mean length of the prefix they share
with it, out of the new tokens: random weights make near ties common, so this is a lower bound of agreement).
Asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from flood_vs_hf import SEED, ling_config  # noqa: E402

from lingctl.flood.engine import native  # noqa: E402
from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest  # noqa: E402
from lingctl.flood.engine.sampling import SamplingParams  # noqa: E402
from lingctl.model.ling import LingForCausalLM  # noqa: E402
from lingctl.model.presets import preset  # noqa: E402


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    new: int


def build(name: str) -> tuple[LingForCausalLM, Workload]:
    rng = random.Random(SEED + 7)
    if name == "tiny":
        config = ling_config("moe", 1024)
        model = LingForCausalLM(config)
        model.init_weights(torch.Generator().manual_seed(SEED))
        prompts = [[rng.randrange(1, config.vocab_size) for _ in range(rng.randint(48, 80))] for _ in range(64)]
        work = Workload(prompts, 64)
    else:
        config = dataclasses.replace(preset("ling-lite"), num_hidden_layers=2)
        model = LingForCausalLM(config)
        model.init_weights(torch.Generator().manual_seed(SEED))
        prompts = [[rng.randrange(1, config.vocab_size) for _ in range(64)] for _ in range(8)]
        work = Workload(prompts, 16)
    model.eval()
    if config.norm_head:
        model.normalize_head_()
    return model, work


def run(model: LingForCausalLM, work: Workload) -> dict:
    kv = sum(len(p) + work.new for p in work.prompts) + 256
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=kv, max_batch_tokens=1024, max_seqs=256))
    reqs = [
        GenRequest(key=i, prompt_ids=p, sampling=SamplingParams(max_tokens=work.new, temperature=0.0))
        for i, p in enumerate(work.prompts)
    ]
    outputs: dict[int, list[int]] = {}
    start = time.perf_counter()
    for res in engine.generate(reqs):
        outputs[res.key] = res.token_ids
    seconds = time.perf_counter() - start
    st = engine.stats
    prompt_tokens = sum(len(p) for p in work.prompts)
    return {
        "seconds": seconds,
        "tokens_per_s": st.generated_tokens / seconds,
        "prompt_tokens_per_s": prompt_tokens / st.prefill_seconds if st.prefill_seconds else None,
        "decode_tokens_per_s": st.decode_step_tokens / st.decode_seconds if st.decode_seconds else None,
        "outputs": outputs,
    }


def switched(on: bool) -> None:
    """flood's native kernels on or off for the engines made next."""
    if on:
        os.environ.pop(native.ENV_SWITCH, None)
    else:
        os.environ[native.ENV_SWITCH] = "0"
    native.kernels.cache_clear()


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(name: str, rounds: int, log) -> dict:
    t0 = time.perf_counter()
    model, work = build(name)
    log(f"[{name}] built in {time.perf_counter() - t0:.1f} s")
    switched(True)
    reference = run(model, work)["outputs"]  # float32, native kernels
    model = model.to(torch.bfloat16)
    best: dict[str, dict] = {}
    for r in range(rounds + 1):  # round 0 warms each side up
        for side in ("native", "torch"):
            switched(side == "native")
            res = run(model, work)
            log(f"[{name}] round {r}: {side:6} {res['seconds']:.2f} s  {res['tokens_per_s']:.1f} tok/s")
            if r and (side not in best or res["seconds"] < best[side]["seconds"]):
                best[side] = res
    switched(True)
    row: dict = {"model": name, "requests": len(work.prompts), "new_tokens": work.new}
    for side, res in best.items():
        prefixes = [shared_prefix(res["outputs"][k], reference[k]) for k in reference]
        row[side] = {k: v for k, v in res.items() if k != "outputs"}
        row[side]["prefix_with_float32"] = sum(prefixes) / len(prefixes)
    row["native_x"] = best["torch"]["seconds"] / best["native"]["seconds"]
    same = sum(best["native"]["outputs"][k] == best["torch"]["outputs"][k] for k in reference)
    row["native_equals_torch"] = f"{same}/{len(reference)}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,ling-lite-2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = native.kernels()
    if k is None:
        sys.exit(f"flood's native kernels are unavailable here: {native.why_unavailable()}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows = [measure(m, args.rounds, log) for m in args.models.split(",")]
    result = {"threads": args.threads, "bf16_instructions": k.bf16_dot, "torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"flood bf16 experts, {args.threads} thread(s), AVX-512 BF16 {'used' if k.bf16_dot else 'not available'}; "
        f"torch {torch.__version__}; best of {args.rounds} alternating rounds"
    )
    print(
        f"{'model':12} {'side':7} {'total s':>8} {'tok/s':>8} {'prompt tok/s':>13} {'decode tok/s':>13} {'prefix/new':>11}"
    )
    for row in rows:
        for side in ("native", "torch"):
            s = row[side]
            print(
                f"{row['model']:12} {side:7} {s['seconds']:8.2f} {s['tokens_per_s']:8.1f} "
                f"{s['prompt_tokens_per_s'] or 0:13.1f} {s['decode_tokens_per_s'] or 0:13.1f} "
                f"{s['prefix_with_float32']:6.1f}/{row['new_tokens']}"
            )
        print(f"{'':12} native / torch: {row['native_x']:.2f}x; identical greedy tokens {row['native_equals_torch']}")


if __name__ == "__main__":
    main()
