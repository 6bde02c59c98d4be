"""flood at real size: load time against a plain read of the files, peak memory against the plan, decode speed.

    flock /tmp/lingctl-bench.lock python bench/flood_real_size.py /work/scratch/ling-lite \
        [--runs float32:8,float32:1,bfloat16:8] [--new-tokens 16]

For a checkpoint directory (e.g. from bench/ling_lite_checkpoint.py):
1. a plain sequential read of every weight file, cold (each file dropped from the page cache first with
   POSIX_FADV_DONTNEED), in 64 MiB reads: the floor for any loader;
2. ``lingctl flood run --quantize int8 --json`` (or ``--quantize w8a8``) as a subprocess, cold as well, for each ``DTYPE:BATCH`` of
   ``--runs``: BATCH requests of 64 random token ids (8-16 new tokens, greedy); the summary gives the load
   time and bytes, the peak RSS, the plan and its parts, and generated tok/s (prefill included);
3. ``--dtype bfloat16`` without int8: expected to be refused before any weight is read (time to refusal).

Prints a table of figures and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_LOAD = 1.3
GOAL_PEAK = 1.10


def weight_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a checkpoint just written) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(files: list[Path]) -> tuple[float, int]:
    evict(files)
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    total = 0
    t = time.monotonic()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # keep the page cache as the loader leaves it
        os.close(fd)
    return time.monotonic() - t, total


def batch_file(tmp: Path, n: int, vocab: int, new_tokens: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = tmp / f"batch{n}.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            ids = [rng.randrange(2, vocab - 1) for _ in range(64)]
            f.write(
                json.dumps(
                    {
                        "custom_id": f"r{i}",
                        "prompt": ids,
                        "max_tokens": rng.randint(8, new_tokens),
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                )
                + "\n"
            )
    return path


def flood(ckpt: Path, batch: Path, dtype: str, quantize: str | None, extra: list[str]) -> tuple[int, dict | str, float]:
    cmd = [
        sys.executable,
        "-m",
        "lingctl",
        "flood",
        "run",
        str(batch),
        "--model",
        str(ckpt),
        "--dtype",
        dtype,
        "--json",
        "-o",
        str(batch.with_suffix(f".{dtype}.{quantize}.out.jsonl")),
        *extra,
    ]
    if quantize:
        cmd += ["--quantize", quantize]
    t = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.monotonic() - t
    if res.returncode != 0:
        return res.returncode, res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "", dt
    return 0, json.loads(res.stdout), dt


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--runs", default="float32:8,float32:1,bfloat16:8", help="DTYPE:BATCH,... with --quantize int8")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--no-refusal", action="store_true", help="skip the bfloat16-without-int8 run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantize", default="int8", choices=["int8", "w8a8"])
    args = ap.parse_args()
    files = weight_files(args.ckpt)
    config = json.loads((args.ckpt / "config.json").read_text())
    size = sum(p.stat().st_size for p in files)
    print(f"checkpoint {args.ckpt}: {len(files)} files, {size / 1e9:.2f} GB, {config['num_hidden_layers']} layers")
    read_s, read_bytes = plain_read(files)
    print(
        f"plain sequential read (cold): {read_bytes / 1e9:.2f} GB in {read_s:.1f} s = "
        f"{read_bytes / read_s / 1e6:.0f} MB/s"
    )
    extra = ["--threads", str(args.threads)] if args.threads else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for spec in args.runs.split(","):
            dtype, n = spec.split(":")
            batch = batch_file(tmp, int(n), config["vocab_size"], args.new_tokens)
            evict(files)
            rc, s, wall = flood(args.ckpt, batch, dtype, args.quantize, extra)
            if rc != 0:
                print(f"int8 {dtype} batch {n}: exit {rc}: {s}")
                continue
            assert isinstance(s, dict)
            p = s["plan"]
            rows.append((dtype, int(n), s, wall))
            print(f"\nint8, --dtype {dtype}, batch {n}: {s['succeeded']}/{s['requests']} answered, wall {wall:.1f} s")
            print(
                f"  load {s['load_seconds']:.1f} s for {s['load_bytes_read'] / 1e9:.2f} GB read = "
                f"{s['load_seconds'] / read_s:.2f}x the plain read (goal <= {GOAL_LOAD}x); bytes read / file bytes "
                f"{s['load_bytes_read'] / read_bytes:.4f}"
            )
            print(
                f"  peak RSS {gib(s['peak_rss_bytes'])} vs plan {gib(s['plan_total_bytes'])} = "
                f"{s['peak_rss_bytes'] / s['plan_total_bytes']:.3f} (goal <= {GOAL_PEAK})"
            )
            print(
                f"  plan: runtime {gib(p['runtime_bytes'])} + weights {gib(p['weights_bytes'])} + max(loader "
                f"{gib(p['loader_bytes'])}, packed {gib(p['engine_bytes'])} + activations "
                f"{gib(p['activation_bytes'])} + KV {gib(p['kv_bytes'])}); available {gib(p['available_bytes'])}"
            )
            print(
                f"  generation: {s['generated_tokens']} tokens in {s['seconds']:.1f} s = "
                f"{s['generated_tokens_per_s']:.2f} tok/s (prefill included)"
            )
        if not args.no_refusal:
            batch = batch_file(tmp, 8, config["vocab_size"], args.new_tokens)
            rc, s, wall = flood(args.ckpt, batch, "bfloat16", None, extra)
            print(f"\n--dtype bfloat16 without int8: exit {rc} after {wall:.1f} s: {s if rc else 'ran'}")
    print("\n| dtype | batch | load s | plain read s | load/read | peak RSS | plan | peak/plan | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, n, s, _ in rows:
        print(
            f"| {dtype} | {n} | {s['load_seconds']:.1f} | {read_s:.1f} | {s['load_seconds'] / read_s:.2f}x | "
            f"{gib(s['peak_rss_bytes'])} | {gib(s['plan_total_bytes'])} | "
            f"{s['peak_rss_bytes'] / s['plan_total_bytes']:.3f} | {s['generated_tokens_per_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
