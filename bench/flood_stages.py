"""When do flood's pipeline stages pay off? One process vs ``--stages 2`` on the same machine and requests.

A 4-layer Ling MoE (the benchmark model of ``flood_vs_hf.py``: hidden 256, 64 experts top-6, 2 shared) is
saved to a temporary checkpoint; N greedy requests (48-80 prompt tokens, 32 new) run through

- one process with 1 thread and with all cores' threads (what ``--stages 1`` does),
- ``--stages 2``: two stage processes of one thread each, fed by this process (the scheduler).

Each configuration runs twice after a warm-up run; the better run counts. Outputs are compared: they must be
identical (pipeline stages do not change answers).

    .venv/bin/python bench/flood_stages.py [--requests 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flood_vs_hf import build_ling, ling_config, workload_a  # noqa: E402

from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest, LocalRunner  # noqa: E402
from lingctl.flood.engine.pipeline import PipelineRunner  # noqa: E402
from lingctl.flood.engine.sampling import SamplingParams  # noqa: E402
from lingctl.flood.engine.segment_cache import KVPool  # noqa: E402
from lingctl.flood.weights.model_dir import ModelDir  # noqa: E402
from lingctl.model.checkpoint import save_checkpoint  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, dict[int, list[int]]]:
    reqs = [
        GenRequest(key=i, prompt_ids=p, sampling=SamplingParams(max_tokens=new, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    t = time.perf_counter()
    out = {r.key: r.token_ids for r in engine.generate(reqs)}
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    config = ling_config("moe", 1024)
    prompts = workload_a(config.vocab_size, args.requests, args.new).prompts
    kv = sum(len(p) for p in prompts) + args.requests * args.new + 64
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "moe"
        save_checkpoint(build_ling(config), ckpt)
        md = ModelDir.open(ckpt)

        def local(threads: int) -> Engine:
            torch.set_num_threads(threads)
            model = md.load(dtype=torch.float32)
            c = md.config
            pool = KVPool(c.num_hidden_layers, kv + 1, c.num_key_value_heads, c.head_dim, torch.float32)
            return Engine(EngineConfig(kv_cache_tokens=kv), model_config=c, runner=LocalRunner(model, pool))

        setups = [
            ("one process, 1 thread", lambda: local(1)),
            (f"one process, {cores} threads", lambda: local(cores)),
            (
                "2 stages x 1 thread",
                lambda: Engine(
                    EngineConfig(kv_cache_tokens=kv, stages=2),
                    model_config=md.config,
                    runner=PipelineRunner(
                        ckpt, stages=2, dtype=torch.float32, quantize=None, kv_cache_tokens=kv, threads_per_stage=1
                    ),
                ),
            ),
        ]
        reference = None
        for name, make in setups:
            engine = make()
            try:
                run(engine, prompts[:8], 4)  # warm-up
                best = None
                for _ in range(2):
                    seconds, out = run(engine, prompts, args.new)
                    best = seconds if best is None else min(best, seconds)
                    reference = reference or out
                    if out != reference:
                        raise SystemExit(f"{name}: outputs differ from the first configuration")
            finally:
                engine.close()
            tokens = args.requests * args.new
            assert best is not None  # two timed rounds ran
            results[name] = {
                "seconds": round(best, 3),
                "tokens_per_s": round(tokens / best, 1),
                "steps": engine.stats.scheduler.steps,
            }
    base = results["one process, 1 thread"]["tokens_per_s"]
    for r in results.values():
        r["vs_one_thread"] = round(r["tokens_per_s"] / base, 2)
    report = {
        "requests": args.requests,
        "new_tokens": args.new,
        "cores": cores,
        "torch": torch.__version__,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{args.requests} greedy requests x {args.new} new tokens, 4-layer MoE (31M), {cores} cores, "
        f"torch {torch.__version__}; outputs identical across configurations"
    )
    for name, r in results.items():
        print(
            f"  {name:<28} {r['seconds']:7.2f} s {r['tokens_per_s']:9.1f} tok/s  x{r['vs_one_thread']:.2f}"
            f"  ({r['steps']} steps)"
        )


if __name__ == "__main__":
    main()
