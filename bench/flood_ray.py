"""``lingctl flood run --ray`` against a local run on the same requests, and two engines against one.

The workload is the tiny Ling MoE of ``flood_vs_hf.py`` (4 layers, hidden 256, 64 experts top-6, two shared
experts, vocab 8192; fp32) saved as a checkpoint, and a batch of random token-id prompts (16-64 tokens) with
greedy answers. Every run is a real ``lingctl flood run --json`` subprocess with ``--threads 1`` (each engine
too), so the figures are what a user gets:

- ``local``: one process, no Ray;
- ``ray, 1 engine``: a cluster of a head without CPUs and one node of one CPU (Ray's own ``cluster_utils``, real
  raylets and workers on this machine), ``--ray-engines 1``;
- ``ray, 2 engines``: the same cluster with a second one-CPU node.

For each: the whole command's wall time (process start to exit: for ``--ray`` that includes connecting, starting
the engines and each engine's model load) and flood's engine-phase tokens/s (generated tokens over the
generation phase: for ``--ray`` from the first block sent to the last answer back). Every output is compared with
the local run's, byte for byte (``SOURCE_DATE_EPOCH`` set).

Goal (printed, never asserted): ``--ray`` with one engine >= 0.9x the local engine-phase tokens/s. On a 2-core
machine two engines cannot gain much: the driver, both engines and Ray's own processes share the two cores.

    .venv/bin/python bench/flood_ray.py [--requests 256] [--max-tokens 64] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flood_vs_hf import build_ling, ling_config  # noqa: E402

from lingctl.model.checkpoint import save_checkpoint  # noqa: E402

GOAL = 0.9
EPOCH = "1700000000"
NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 100 * 1024 * 1024}


def write_batch(path: Path, requests: int, max_tokens: int) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(requests):
            ids = [rng.randrange(3, 8000) for _ in range(rng.randint(16, 64))]
            body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


def clear(out: Path) -> bytes:
    """Remove a run's files (output, errors, manifest), so the next run writes afresh; returns the output."""
    data = out.read_bytes()
    for f in (out, out.with_name(out.stem + ".errors.jsonl"), out.with_name(out.name + ".manifest.json")):
        f.unlink(missing_ok=True)
    return data


def flood(batch: Path, model: Path, out: Path, env: dict[str, str], *extra: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lingctl", "flood", "run", str(batch), "--model", str(model), "-o", str(out)]
    started = time.monotonic()
    done = subprocess.run([*cmd, "--threads", "1", "--json", *extra], capture_output=True, text=True, env=env)
    wall = time.monotonic() - started
    if done.returncode:
        sys.exit(f"flood_ray: {' '.join(extra) or 'local'} run failed: {done.stderr.strip()[-2000:]}")
    summary = json.loads(done.stdout)
    return {"wall_s": wall, "tok_s": summary["generated_tokens_per_s"], "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    # --ray-block; 0: the default (here one block per engine: 256 with one engine, 128 with two).
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory(prefix="flood-ray-bench-") as tmp:
        work = Path(tmp)
        model = work / "tiny-moe"
        save_checkpoint(build_ling(ling_config("moe", 0)), model)
        batch = write_batch(work / "batch.jsonl", args.requests, args.max_tokens)
        env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "LINGCTL_CACHE_DIR": str(work / "cache")}
        # Flood's kernels are compiled once, before anything is timed.
        subprocess.run([sys.executable, "-c", "from lingctl.flood.engine.native import kernels; kernels()"],
                       env=env, check=True)  # fmt: skip
        saved = dict(os.environ)
        os.environ.update({"LINGCTL_CACHE_DIR": env["LINGCTL_CACHE_DIR"]})  # the nodes' engines use it too
        cluster = Cluster(
            initialize_head=True, connect=False, head_node_args={"num_cpus": 0, "include_dashboard": False}
        )
        try:
            cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            runs: dict[str, list[dict[str, Any]]] = {"local": [], "ray, 1 engine": [], "ray, 2 engines": []}
            ray = ["--ray-address", cluster.address, *(["--ray-block", str(args.block)] if args.block else [])]
            for _ in range(args.repeat):  # interleaved, so a change in the machine's load hits every variant
                runs["local"].append(flood(batch, model, work / "local.jsonl", env))
                runs["ray, 1 engine"].append(flood(batch, model, work / "ray1.jsonl", env, *ray, "--ray-engines", "1"))
                clear(work / "local.jsonl")
                clear(work / "ray1.jsonl")
            cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            for _ in range(args.repeat):
                runs["ray, 2 engines"].append(flood(batch, model, work / "ray2.jsonl", env, *ray))
                last = clear(work / "ray2.jsonl")
            runs["local"].append(flood(batch, model, work / "local.jsonl", env))
            same = (work / "local.jsonl").read_bytes() == last
        finally:
            cluster.shutdown()
            os.environ.clear()
            os.environ.update(saved)
    report(runs, same, args)


def report(runs: dict[str, list[dict[str, Any]]], same: bool, args: argparse.Namespace) -> None:
    rows = {}
    for name, rs in runs.items():
        engines = rs[-1]["summary"].get("cluster") or {}
        rows[name] = {
            "wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
            "tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
            "engine_phase_s": round(statistics.median(r["summary"]["seconds"] for r in rs), 2),
            "engines": len(engines.get("engines", [])),
            "blocks": engines.get("blocks"),
            "load_s": round(statistics.median(r["summary"]["load_seconds"] for r in rs), 2),
        }
    local, one, two = rows["local"], rows["ray, 1 engine"], rows["ray, 2 engines"]
    result = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "block": args.block,
        "load_average": os.getloadavg()[0],
        "rows": rows,
        "ray1_vs_local_tok_s": round(one["tok_s"] / local["tok_s"], 3),
        "ray1_vs_local_wall": round(one["wall_s"] / local["wall_s"], 3),
        "ray2_vs_ray1_tok_s": round(two["tok_s"] / one["tok_s"], 3),
        "outputs_identical": same,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.requests} requests x {args.max_tokens} tokens, median of {args.repeat}; load average {result['load_average']:.2f}"
    )
    print(f"{'variant':16s} {'wall s':>7s} {'engine s':>8s} {'tok/s':>8s} {'load s':>6s} {'blocks':>6s}")
    for name, r in rows.items():
        print(
            f"{name:16s} {r['wall_s']:7.2f} {r['engine_phase_s']:8.2f} {r['tok_s']:8.1f} {r['load_s']:6.2f} {r['blocks'] or '':>6}"
        )
    ratio = result["ray1_vs_local_tok_s"]
    print(f"--ray, 1 engine / local: {ratio:.2f}x tok/s (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'}), "
          f"{result['ray1_vs_local_wall']:.2f}x wall time")  # fmt: skip
    print(f"2 engines / 1: {result['ray2_vs_ray1_tok_s']:.2f}x tok/s; outputs identical to local: {same}")


if __name__ == "__main__":
    main()
