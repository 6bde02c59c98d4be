"""flood against llama.cpp on a Ling-lite-shaped checkpoint in int8, in one run, at the same thread count.

    make bench-llamacpp                                   # llama.cpp and its converter, once (~10 min)
    python bench/ling_lite_checkpoint.py --out CKPT       # 33.6 GB of random bf16 + a generated tokenizer
    .bench/venv-llamacpp/bin/python bench/llamacpp_convert.py .bench/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        CKPT --outtype q8_0 --outfile LING.gguf           # llama.cpp's own converter (17.9 GB)
    lingctl flood quantize CKPT CONVERTED --quantize w8a8 # flood's converted form (17.5 GB), timed as the first load
    flock /tmp/lingctl-bench.lock .venv/bin/python bench/flood_vs_llamacpp.py --converted CONVERTED --gguf LING.gguf \\
        [--original CKPT] [--threads 2] [--prompt 64] [--new 32] [--batches 1,32] [--json]

What it measures, in this order (one model in memory at a time: each side needs about 18 GB):
1. the machine's read bandwidth at 1 and ``--threads`` threads (a sum over 2 GiB), and the batch-1 decode bound it
   implies: the int8 bytes one token reads (attention, the router, k routed + shared experts per layer, the int8
   head) over that bandwidth;
2. a cold sequential read of the converted files (dropped from the page cache first): the floor for any load;
3. flood: ``lingctl flood run`` on the converted checkpoint, cold, one process per batch size: B requests of
   ``--prompt`` random token ids, ``--new`` new tokens each, greedy; the summary gives the load time, the engine
   time (prompt processing and decode split), peak RSS and the plan;
4. llama.cpp: ``llama-batched-bench -npp P -ntg N -npl B...`` with the weights read into memory (``-lm none``),
   then ``llama-bench -p P -n N`` for its prompt and generation rates;
5. with ``--original``: ``flood run --quantize w8a8`` from the bf16 checkpoint (the first load: converting as
   it reads) against a cold read of that checkpoint;
6. with ``--eval-items N``: ``lingctl flood eval`` of N generated 4-choice items (about 60-token contexts in
   the checkpoint's tokenizer) on the converted checkpoint: items/s, load excluded.

Both sides compute the same shapes with random weights; llama.cpp's q8_0 keeps one scale per 32 weights, flood's
int8 one per row. Prints a table of figures and ratios against the goals; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from flood_real_size import evict, plain_read  # noqa: E402

from lingctl.model.config import LingConfig  # noqa: E402

LLAMA_BIN = ROOT / ".bench/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
GOAL_B1 = 1.0  # flood's total time / llama.cpp's, 1 request
GOAL_B32 = 0.5  # the same at 32 requests
GOAL_BOUND = 0.5  # batch-1 decode / the bandwidth bound
GOAL_SECOND_LOAD = 1.2  # load of the converted form / cold read of its bytes
GOAL_FIRST_LOAD = 1.5  # load from the original / cold read of the original


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a sum over 2 GiB of float32 (best of 3), on ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(2**29)
        x.sum()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


def active_int8_bytes(c: LingConfig) -> int:
    """What one decoded token reads: int8 matrices (1 byte per weight, a 4-byte scale per row), the float32
    router, the int8 head; embeddings (one row) and norms are negligible."""
    d = c.hidden_size
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attn = qkv * d + d * c.num_attention_heads * c.head_dim
    experts = (c.num_experts_per_tok + c.num_shared_experts) * 3 * d * c.moe_intermediate_size
    router = c.num_experts * d * 4
    per_layer = attn + experts + router
    return c.num_hidden_layers * per_layer + c.vocab_size * d + 4 * c.vocab_size


def flood_run(
    model: Path, batch: int, prompt: int, new: int, threads: int, extra: list[str], files: list[Path]
) -> dict[str, Any]:
    rng = random.Random(batch)
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "batch.jsonl"
        with open(requests, "w") as f:
            for i in range(batch):
                ids = [rng.randrange(1000, 100000) for _ in range(prompt)]
                f.write(json.dumps({"custom_id": f"r{i}", "prompt": ids, "max_tokens": new, "temperature": 0}) + "\n")
        evict(files)
        cmd = [
            str(ROOT / ".venv/bin/lingctl"), "flood", "run", str(requests), "-m", str(model), "-o",
            str(Path(tmp) / "out.jsonl"), "--threads", str(threads), "--json", *extra,
        ]  # fmt: skip
        t = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t
        if r.returncode != 0:
            raise SystemExit(f"flood run failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        s = json.loads(r.stdout)
    return {
        "batch": batch,
        "wall_s": wall,
        "load_s": s["load_seconds"],
        "load_bytes": s["load_bytes_read"],
        "engine_s": s["seconds"],
        "generated": s["generated_tokens"],
        "prompt_tok_s": s["prompt_tokens_per_s"],
        "decode_tok_s": s["decode_tokens_per_s"],
        "peak_rss": s["peak_rss_bytes"],
        "plan": s["plan_total_bytes"],
    }


WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def flood_eval(model: Path, items: int, threads: int) -> dict[str, Any]:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(tmp) / "mc.jsonl"
        with open(task, "w") as f:
            for i in range(items):
                context = " ".join(rng.choice(WORDS) for _ in range(60)) + "\nAnswer:"
                choices = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(4)]
                f.write(json.dumps({"id": f"q{i}", "context": context, "choices": choices, "answer": 0}) + "\n")
        cmd = [
            str(ROOT / ".venv/bin/lingctl"), "flood", "eval", str(task), "--model", str(model), "-o",
            str(Path(tmp) / "out.jsonl"), "--threads", str(threads), "--json",
        ]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"flood eval failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        s = json.loads(r.stdout)
    m = s["results"][0]
    return {"items": items, "seconds": m["seconds"], "load_s": m["load_seconds"], "items_per_s": items / m["seconds"]}


def llama_batched(
    bin_dir: Path, gguf: Path, prompt: int, new: int, batches: list[int], threads: int
) -> dict[int, dict[str, float]]:
    cmd = [
        str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-lm", "none", "-c", str(max(batches) * (prompt + new) + 64),
        "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new), "-npl", ",".join(map(str, batches)),
        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed: {r.stderr.strip()[-2000:]}")
    rows: dict[int, dict[str, float]] = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "pl" in row:
                rows[int(row["pl"])] = row
    return rows


def llama_bench(bin_dir: Path, gguf: Path, prompt: int, new: int, threads: int) -> dict[str, float]:
    cmd = [
        str(bin_dir / "llama-bench"), "-m", str(gguf), "-lm", "none", "-p", str(prompt), "-n", str(new),
        "-t", str(threads), "-r", "3", "-o", "json",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed: {r.stderr.strip()[-2000:]}")
    out: dict[str, float] = {}
    for test in json.loads(r.stdout):
        key = "pp" if test["n_prompt"] else "tg"
        out[key] = float(test["avg_ts"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converted", type=Path, required=True, help="flood quantize's output")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--original", type=Path, help="the bf16 checkpoint: also measure the first load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--eval-items", type=int, default=0)
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN, help="llama.cpp's build/bin")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config = LingConfig.load(args.converted / "config.json")
    files = sorted(args.converted.glob("*.safetensors"))
    res: dict[str, Any] = {"threads": args.threads, "prompt": args.prompt, "new": args.new}
    bw1, bwn = read_bandwidth(1), read_bandwidth(args.threads)
    per_token = active_int8_bytes(config)
    res["bandwidth"] = {"one_thread": bw1, "threads": bwn, "bytes_per_token": per_token, "bound_tok_s": bwn / per_token}
    res["cold_read_s"], res["cold_read_bytes"] = plain_read(files)
    res["flood"] = [flood_run(args.converted, b, args.prompt, args.new, args.threads, [], files) for b in batches]
    if args.original is not None:
        ofiles = sorted(args.original.glob("*.safetensors"))
        res["original_cold_read_s"], _ = plain_read(ofiles)
        first = flood_run(args.original, 1, args.prompt, 2, args.threads, ["--quantize", "w8a8"], ofiles)
        res["first_load_s"] = first["load_s"]
    if args.eval_items:
        res["eval"] = flood_eval(args.converted, args.eval_items, args.threads)
    if not args.skip_llama:
        res["llama_batched"] = llama_batched(args.llama_bin, args.gguf, args.prompt, args.new, batches, args.threads)
        res["llama_bench"] = llama_bench(args.llama_bin, args.gguf, args.prompt, args.new, args.threads)
    if args.json:
        print(json.dumps(res, indent=2))
    report(res)


def report(res: dict[str, Any]) -> None:
    bw = res["bandwidth"]
    print(
        f"read bandwidth: {bw['one_thread'] / 1e9:.1f} GB/s (1 thread), {bw['threads'] / 1e9:.1f} GB/s "
        f"({res['threads']} threads); a token reads {bw['bytes_per_token'] / 1e9:.2f} GB -> bound "
        f"{bw['bound_tok_s']:.1f} tok/s"
    )
    llama = res.get("llama_batched", {})
    print("| B | flood T (s) | prompt tok/s | decode tok/s | llama.cpp T (s) | PP t/s | TG t/s | flood/llama |")
    print("|---|---|---|---|---|---|---|---|")
    for f in res["flood"]:
        row = llama.get(f["batch"]) or llama.get(str(f["batch"]))
        lt = f"{row['t']:.2f}" if row else "-"
        ratio = f"{f['engine_s'] / row['t']:.2f}" if row else "-"
        pp = f"{row['speed_pp']:.1f}" if row else "-"
        tg = f"{row['speed_tg']:.1f}" if row else "-"
        print(
            f"| {f['batch']} | {f['engine_s']:.2f} | {f['prompt_tok_s']:.1f} | {f['decode_tok_s']:.2f} | {lt} | {pp} "
            f"| {tg} | {ratio} |"
        )
    b1 = next((f for f in res["flood"] if f["batch"] == 1), None)
    if b1 is not None:
        print(
            f"batch-1 decode {b1['decode_tok_s']:.2f} tok/s = {b1['decode_tok_s'] / bw['bound_tok_s']:.0%} of the "
            f"bound (goal {GOAL_BOUND:.0%})"
        )
    first = res["flood"][0]
    print(
        f"load of the converted form: {first['load_s']:.1f} s for {first['load_bytes'] / 1e9:.2f} GB; cold read "
        f"{res['cold_read_s']:.1f} s -> {first['load_s'] / res['cold_read_s']:.2f}x (goal <= {GOAL_SECOND_LOAD}x); "
        f"peak RSS {first['peak_rss'] / 2**30:.1f} GiB, plan {first['plan'] / 2**30:.1f} GiB "
        f"({first['peak_rss'] / first['plan']:.0%})"
    )
    if "first_load_s" in res:
        print(
            f"first load (from the bf16 checkpoint, converting): {res['first_load_s']:.1f} s; cold read "
            f"{res['original_cold_read_s']:.1f} s -> {res['first_load_s'] / res['original_cold_read_s']:.2f}x "
            f"(goal <= {GOAL_FIRST_LOAD}x)"
        )
    if "eval" in res:
        e = res["eval"]
        print(f"flood eval: {e['items']} items (4 choices) in {e['seconds']:.1f} s = {e['items_per_s']:.2f} items/s")
    if "llama_bench" in res:
        lb = res["llama_bench"]
        print(f"llama-bench: pp{res['prompt']} {lb.get('pp', 0):.1f} t/s, tg{res['new']} {lb.get('tg', 0):.2f} t/s")


if __name__ == "__main__":
    main()
