"""lingctl timer vs torch.profiler: what tracing costs a training step, per traced call, and in log bytes.

One training loop is run three times, each in a fresh process, one after the other:

- ``none``: untraced;
- ``lingctl``: ``lingctl.timer.install(out)`` with the default targets (collectives, optimizer steps,
  DataLoader, outermost forward, backward), writing its compressed log;
- ``torch.profiler``: ``torch.profiler.profile(activities=[CPU])`` around the steps (its default, tracing
  every operator), exported to a Chrome trace at the end as one would.

The loop: the ``tiny`` Ling MoE preset (2 layers, 8 experts top-2), batches of 8 x 128 tokens from a
DataLoader, AdamW, and one ``all_reduce`` of the flattened gradients per step in a one-process gloo group
(what data parallelism adds per step). Step time is the median over the measured steps after a warm-up.

A second measurement times single traced calls: ``dist.all_reduce`` of a 4-element tensor and a forward of
a one-layer module, untraced and traced, in the same process (``install``/``uninstall``).

    .venv/bin/python bench/timer_overhead.py [--steps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOOP = r"""
import json, os, sys, time, statistics
import torch, torch.distributed as dist
from pathlib import Path
torch.set_num_threads(1)
mode, steps, warm, out, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
if mode == "lingctl":
    import lingctl.timer
    lingctl.timer.install(out)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=0, world_size=1)
from lingctl.model.presets import preset
from lingctl.model.ling import LingForCausalLM
cfg = preset("tiny")
model = LingForCausalLM(cfg)
model.init_weights(torch.Generator().manual_seed(0))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
data = torch.randint(0, cfg.vocab_size, (64, 129), generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))
def batches():
    while True:
        for (b,) in loader:
            yield b
it = batches()
def step():
    b = next(it)
    logits = model(b[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(flat)
    opt.step()
times = []
prof = None
if mode == "torch.profiler":
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    prof.__enter__()
for i in range(warm + steps):
    t = time.perf_counter()
    step()
    if i >= warm:
        times.append(time.perf_counter() - t)
trace_bytes = 0
if prof is not None:
    prof.__exit__(None, None, None)
    path = out / "profiler-trace.json"
    prof.export_chrome_trace(str(path))
    trace_bytes = path.stat().st_size
dist.destroy_process_group()
if mode == "lingctl":
    import lingctl.timer
    lingctl.timer.uninstall()
    trace_bytes = sum(p.stat().st_size for p in out.glob("*.trace.zst"))
    from lingctl.timer.logs import read_log
    records = sum(len(read_log(p)) for p in out.glob("*.trace.zst"))
else:
    records = 0
print(json.dumps({"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
                  "trace_bytes": trace_bytes, "steps": warm + steps, "records": records}))
"""

CALLS = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from pathlib import Path
torch.set_num_threads(1)
out, n, port = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=0, world_size=1)
x = torch.zeros(4)
lin = torch.nn.Linear(4, 4)
def per_call(fn):
    for _ in range(200):
        fn()
    best = None
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t) / n
        best = dt if best is None else min(best, dt)
    return best
fns = {"all_reduce": lambda: dist.all_reduce(x), "forward": lambda: lin(x)}
before = {k: per_call(f) for k, f in fns.items()}
import lingctl.timer
lingctl.timer.install(out)
# One optimizer step ends the tracer's first step, after which only the outermost module (here ``lin``)
# keeps forward hooks.
opt = torch.optim.SGD(lin.parameters(), lr=0.0)
lin(x)
opt.step()
after = {k: per_call(f) for k, f in fns.items()}
lingctl.timer.uninstall()
dist.destroy_process_group()
print(json.dumps({k: {"untraced_us": before[k] * 1e6, "traced_us": after[k] * 1e6,
                      "overhead_us": (after[k] - before[k]) * 1e6} for k in fns}))
"""


def _run(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter with ``args`` and a free port last; its last stdout line is JSON."""
    from lingctl.core.net import free_port

    res = subprocess.run(
        [sys.executable, "-c", code, *args, str(free_port())], capture_output=True, text=True, timeout=900
    )
    if res.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6, help="each mode runs this many times; the best counts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    results: dict[str, dict] = {}
    modes = ["none", "lingctl", "torch.profiler"]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            # Fresh processes differ by several percent in step time (placement, frequency); rotating the
            # order and keeping each mode's best round keeps that out of the comparison.
            for mode in modes[r % 3 :] + modes[: r % 3]:
                out = Path(tmp) / f"{mode}-{r}"
                out.mkdir()
                res = _run(LOOP, mode, str(args.steps), str(args.warmup), str(out))
                best = results.get(mode)
                if best is None or res["median_s"] < best["median_s"]:
                    results[mode] = res
        calls_out = Path(tmp) / "calls"
        calls_out.mkdir()
        calls = _run(CALLS, str(calls_out), "20000")
    base = results["none"]["median_s"]
    report = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cores": len(os.sched_getaffinity(0)),
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": {m: round(r["median_s"] * 1e3, 3) for m, r in results.items()},
        "overhead_pct": {m: round(100 * (r["median_s"] / base - 1), 2) for m, r in results.items() if m != "none"},
        "log_bytes_per_step": {
            "lingctl": round(results["lingctl"]["trace_bytes"] / results["lingctl"]["steps"], 1),
            "torch.profiler": round(results["torch.profiler"]["trace_bytes"] / results["torch.profiler"]["steps"], 1),
        },
        "per_call": calls,
        "records_per_step": round(results["lingctl"]["records"] / results["lingctl"]["steps"], 2),
    }
    # Fresh processes differ by a few percent in step time, more than tracing costs; the overhead implied by
    # the per-call cost times the traced calls per step is the resolvable figure.
    worst_call_s = max(c["overhead_us"] for c in calls.values()) * 1e-6
    report["implied_overhead_pct"] = round(100 * report["records_per_step"] * worst_call_s / base, 3)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"tiny Ling MoE training step, 1 thread, torch {report['torch']}, {args.steps} steps after "
        f"{args.warmup} warm-up, best of {args.rounds} rounds"
    )
    for mode in ("none", "lingctl", "torch.profiler"):
        pct = report["overhead_pct"].get(mode)
        extra = "" if pct is None else f"  overhead {pct:+.2f}%"
        log = report["log_bytes_per_step"].get(mode)
        logs = "" if log is None else f"  log {log:,.0f} B/step"
        print(f"  {mode:<15} step {report['step_ms'][mode]:8.3f} ms{extra}{logs}")
    for name, c in calls.items():
        print(
            f"  per call, {name:<11} untraced {c['untraced_us']:.2f} us, traced {c['traced_us']:.2f} us, "
            f"overhead {c['overhead_us']:.2f} us"
        )
    print(
        f"  {report['records_per_step']} traced calls per step x at most "
        f"{max(c['overhead_us'] for c in calls.values()):.1f} us each = {report['implied_overhead_pct']:.3f}% of a step "
        f"(the measured step-time difference above is within run-to-run noise)"
    )
    goals = [
        ("step overhead <= 0.5% (implied by per-call cost)", report["implied_overhead_pct"] <= 0.5),
        ("<= 1 us per traced call", max(c["overhead_us"] for c in calls.values()) <= 1.0),
        ("<= 1 KB compressed log per step per rank", report["log_bytes_per_step"]["lingctl"] <= 1024),
    ]
    for text, met in goals:
        print(f"  goal {text}: {'met' if met else 'NOT met'}")
    ratio = report["overhead_pct"]["torch.profiler"]
    print(
        f"  torch.profiler costs {ratio:+.1f}% per step and writes "
        f"{report['log_bytes_per_step']['torch.profiler']:,.0f} B/step (uncompressed Chrome trace)"
    )


if __name__ == "__main__":
    main()
