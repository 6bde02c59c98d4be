"""The training watchdog: detection time, recovery time and lost steps per fault drill, and its cost per step.

Each drill is a real ``lingctl train --preset tiny --nproc 2`` job (synchronous DDP workers on gloo) whose
figures are read back from the run's ``incidents.jsonl``:

- ``nan``: the loss of step 7 is NaN -> rollback to the last checkpoint (step 6), learning rate x0.5;
- ``spikes``: 6 spikes in a row from step 9 -> rollback;
- ``hang``: rank 1 blocks at step 8 inside a receive nobody sends -> the launcher's verdict (default hang timeout), restart;
- ``crash``: rank 1 is SIGKILLed after step 8 -> restart.

Cost: the same 40-step job with ``--watchdog`` and ``--no-watchdog``, alternated ``--rounds`` times; the
median step time of each (from metrics.jsonl, first 5 steps left out), and the per-step cost of the
in-worker checks (routing and straggler observers) timed alone, against the step time. The launcher-side
watchdog reads the timer's shared-memory rings from another process: its cost to the ranks is the tracer's
per-call cost (``bench/timer_overhead.py``).

    .venv/bin/python bench/train_watchdog.py [--rounds 3] [--only nan,spikes,hang,crash,cost] [--json]

Like the peer (torchelastic's agent, which restarts only dead workers and never looks for hangs or
divergence), restarts go through a new rendezvous; the figures to compare with published systems are the
detection and recovery times and the lost steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ("train", "--preset", "tiny", "--eval-every", "0", "--nproc", "2", "--save-every", "3")
DRILLS = {
    "nan": ("--steps", "12", "--simulate-nan", "7"),
    "spikes": ("--steps", "16", "--simulate-spikes", "9:6"),
    "hang": ("--steps", "12", "--simulate-hang", "1:8", "--max-restarts", "1"),
    "crash": ("--steps", "12", "--set", "crash_at_step=8", "--set", "crash_rank=1", "--max-restarts", "1"),
}


def lingctl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lingctl", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def corpus(root: Path) -> Path:
    import sysconfig

    out = root / "corpus"
    out.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "string.py", "heapq.py", "bisect.py"):
        (out / name.replace("/", "_")).write_bytes((stdlib / name).read_bytes())
    return out


def drill(name: str, data: Path, root: Path) -> dict:
    run = root / f"run-{name}"
    t0 = time.monotonic()
    res = lingctl(*BASE, *DRILLS[name], "--data", str(data), "--out", str(run), "--json")
    wall = time.monotonic() - t0
    incidents = []
    if (run / "incidents.jsonl").exists():
        incidents = [json.loads(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
    main = [r for r in incidents if r["kind"] in ("hang", "crash", "divergence")]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if run.exists() else []
    step_s = statistics.median(r["step_s"] for r in steps if r.get("event") == "step") if steps else None
    out = {"drill": name, "exit": res.returncode, "wall_s": round(wall, 1), "median_step_s": step_s}
    if main:
        r = main[0]
        out.update(
            kind=r["kind"],
            action=r["action"],
            detected_after_s=r["detected_after_s"],
            recovery_s=r["recovery_s"],
            lost_steps=r["lost_steps"],
            restored_step=r["restored_step"],
        )
    else:
        out["error"] = res.stderr.strip().splitlines()[-3:]
    return out


def median_step(run: Path) -> float:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_s"] for r in steps if r.get("event") == "step" and r["step"] > 5)


def cost(data: Path, root: Path, rounds: int) -> dict:
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        for mode in ("on", "off"):
            run = root / f"cost-{mode}-{i}"
            flag = "--watchdog" if mode == "on" else "--no-watchdog"
            res = lingctl(*BASE, "--steps", "40", "--save-every", "0", flag, "--data", str(data), "--out", str(run))
            if res.returncode != 0:
                raise SystemExit(res.stderr)
            times[mode].append(median_step(run))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "step_s_watchdog": on,
        "step_s_without": off,
        "ratio": round(on / off, 3),
        "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "observers_us_per_step": observer_cost(),
        "observers_share_of_step": round(observer_cost() * 1e-6 / off, 5),
    }


def observer_cost(n: int = 2000) -> float:
    """Microseconds per step of the in-worker checks, on the tiny preset's shapes (1 MoE layer of 8 experts,
    top-2, 8 x 64 tokens per step; 2 workers)."""
    import torch

    from lingctl.model.moe import RouterOutput
    from lingctl.runs.train_config import HealthConfig
    from lingctl.train.supervise.health import RoutingHealth, StragglerWatch

    config = HealthConfig()
    routing = RoutingHealth(config, [1], 8)
    stragglers = StragglerWatch(config, 2)
    idx = torch.randint(0, 8, (512, 2))
    route = RouterOutput(idx, torch.rand(512, 2), torch.rand(512, 8), torch.rand(512, 8))
    paces = [torch.tensor([0.1, 0.1]), torch.tensor([0.01, 0.01]), torch.tensor([0.08, 0.08])]
    t0 = time.perf_counter()
    for i in range(n):
        routing.observe(float(i), [route])
        stragglers.observe(float(i), *paces)
    return round((time.perf_counter() - t0) / n * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="nan,spikes,hang,crash,cost")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wanted = args.only.split(",")
    results: dict = {"drills": []}
    with tempfile.TemporaryDirectory(prefix="lingctl-bench-watchdog-") as tmp:
        root = Path(tmp)
        data = corpus(root)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        for name in DRILLS:
            if name in wanted:
                r = drill(name, data, root)
                results["drills"].append(r)
                if not args.json:
                    print(json.dumps(r), flush=True)
        if "cost" in wanted:
            results["cost"] = cost(data, root, args.rounds)
            if not args.json:
                print(json.dumps(results["cost"]), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
