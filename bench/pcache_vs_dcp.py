"""lingctl pcache vs torch DCP: checkpoint save time across nodes, bytes per node, peak extra memory per rank.

The state of every rank is what pure data parallelism with a sharded optimizer holds for a small MoE: the
model's parameters, replicated on every rank and in the order a model's ``state_dict`` has them (embedding,
then per layer attention, router, experts, shared expert, norms; final norm; LM head), then the optimizer's
rank-unique part: a DTensor sharded over all ranks and one plain tensor per rank whose size differs by rank.

1. Save time. 4 processes as 2 nodes x 2 ranks (and 4 nodes x 1 rank). Each emulated node's disk is a
   ``NodeThrottle``: one FIFO pipe of a fixed bandwidth shared by the node's ranks, with a few MiB of
   write-back. One layout also gives every rank its own stream limit (``Throttles``: node link and rank
   stream together), as a network filesystem or object store has per stream. All three plans write
   through the same ``PCacheWriter``, so only the plan differs: DCP's default planner, rank-0 writers
   (``dedup_save_to_lowest_rank=True``), and ``PCacheSavePlanner`` told the node bandwidths.
2. Peak extra memory per rank, no throttle, each mode in fresh processes: ``dcp.async_save`` and ``dcp.save``
   with the stock ``FileSystemWriter``, lingctl (``PCacheSavePlanner`` + ``PCacheWriter``), and ``torch.save``
   of the full state on rank 0.

    .venv/bin/python bench/pcache_vs_dcp.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support.dist when run as a script

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter  # noqa: E402

from lingctl.pcache.save_planner import PCacheSavePlanner  # noqa: E402
from lingctl.pcache.throttle import NodeThrottle, Throttles  # noqa: E402
from lingctl.pcache.writer import PCacheWriter  # noqa: E402
from tests.support.dist import run_workers  # noqa: E402

MiB = 1 << 20
WORLD = 4
BUFFER = CHUNK = 8 * MiB  # lingctl's staging buffer and split size
PLANS = ("dcp", "rank0", "lingctl")
PLAN_NAMES = {"dcp": "DCP default", "rank0": "rank-0 writers", "lingctl": "lingctl"}
MEM_MODES = ("async_save", "dcp.save", "lingctl", "torch.save")


# -- the state ---------------------------------------------------------------------------------------
def model_shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """A small MoE's parameters in ``state_dict`` order (fp32): ~47 MiB, 235 tensors (quick: ~3 MiB)."""
    hidden, vocab, layers, experts, width = (128, 2048, 2, 4, 64) if quick else (256, 8192, 4, 16, 128)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [(p + "input_norm.weight", (hidden,))]
        shapes += [(p + f"attn.{n}.weight", (hidden, hidden)) for n in ("q", "k", "v", "o")]
        shapes += [(p + "post_norm.weight", (hidden,)), (p + "mlp.router.weight", (experts, hidden))]
        for e in range(experts):
            shapes += [
                (p + f"mlp.experts.{e}.{n}.weight", (width, hidden) if n != "down" else (hidden, width))
                for n in ("gate", "up", "down")
            ]
        shapes += [(p + f"mlp.shared.{n}.weight", (hidden, hidden)) for n in ("gate", "up", "down")]
    return shapes + [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def unique_shape(rank: int, quick: bool) -> tuple[int, int]:
    """The rank's own optimizer tensor: 1.5, 3, 4.5, 6 MiB for ranks 0-3 (quick: 1/16 of that)."""
    return ((rank + 1) * (96 if quick else 1536), 256)


SHARDED = (8195, 256)  # ~8 MiB DTensor over 4 ranks; rows do not divide by 4


def replicated(quick: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in model_shapes(quick)}


def unique(rank: int, quick: bool) -> torch.Tensor:
    return torch.randn(unique_shape(rank, quick), generator=torch.Generator().manual_seed(100 + rank))


def make_state(rank: int, world: int, quick: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    rows = SHARDED[0] // 16 if quick else SHARDED[0]
    full = torch.randn((rows, SHARDED[1]), generator=torch.Generator().manual_seed(1))
    optim = {"exp_avg": distribute_tensor(full, mesh, [Shard(0)]), f"rank{rank}": unique(rank, quick)}
    return {"model": replicated(quick), "optim": optim, "step": 1000}


# -- 1. save time ------------------------------------------------------------------------------------
def scenarios(bw: float) -> list[dict]:
    # "streams": each rank's writer is also one stream of bw/2 (a network filesystem's or object store's
    # per-stream limit) under a node link of 2 x bw, so how evenly the ranks of a node share the bytes
    # matters, not only how evenly the nodes do.
    return [
        {"key": "2x2-equal", "ranks_per_node": 2, "bandwidth": [bw, bw]},
        {"key": "2x2-unequal", "ranks_per_node": 2, "bandwidth": [bw, bw / 2]},
        {"key": "2x2-streams", "ranks_per_node": 2, "bandwidth": [2 * bw, 2 * bw], "rank_bandwidth": bw / 2},
        {"key": "4x1-equal", "ranks_per_node": 1, "bandwidth": [bw] * 4},
    ]


def make_planner(plan: str, sc: dict):
    if plan == "dcp":
        return DefaultSavePlanner()
    if plan == "rank0":
        return DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    return PCacheSavePlanner(ranks_per_node=sc["ranks_per_node"], node_bandwidth=sc["bandwidth"], chunk_bytes=CHUNK)


def save_worker(rank: int, world: int, root: str, bw: float, repeats: int, quick: bool) -> list[dict]:
    state = make_state(rank, world, quick)
    runs = [(sc, plan) for sc in scenarios(bw) for plan in PLANS]
    records = []
    for rep in range(repeats):
        # Rotate the order each repeat so slow moments of the shared machine do not always hit one plan.
        for sc, plan in runs[rep % len(runs) :] + runs[: rep % len(runs)]:
            directory = Path(root) / f"{sc['key']}-{plan}-{rep}"
            node = rank // sc["ranks_per_node"]
            node_throttle = NodeThrottle(
                Path(root) / "throttle" / f"{directory.name}-node{node}", sc["bandwidth"][node]
            )
            throttle: NodeThrottle | Throttles = node_throttle
            if "rank_bandwidth" in sc:
                throttle = Throttles(
                    node_throttle,
                    NodeThrottle(Path(root) / "throttle" / f"{directory.name}-rank{rank}", sc["rank_bandwidth"]),
                )
            # No fsync: every emulated node shares this machine's one disk; the throttle is the node's disk.
            writer = PCacheWriter(directory, buffer_bytes=BUFFER, throttle=throttle, sync_files=False)
            planner = make_planner(plan, sc)
            dist.barrier()
            start = time.monotonic()
            dcp.save(state, storage_writer=writer, planner=planner)
            elapsed = time.monotonic() - start
            throttle.close()
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (elapsed, writer.write_seconds, writer.buffer.copied_bytes))
            if rank == 0:
                node_bytes = [0] * (world // sc["ranks_per_node"])
                rank_bytes = [0] * world
                for f in directory.glob("__*_0.distcp"):
                    node_bytes[int(f.name.split("_")[2]) // sc["ranks_per_node"]] += f.stat().st_size
                    rank_bytes[int(f.name.split("_")[2])] += f.stat().st_size
                est = planner.summary.estimated_s if plan == "lingctl" else None
                records.append(
                    {
                        "scenario": sc["key"],
                        "plan": plan,
                        "rep": rep,
                        "node_bytes": node_bytes,
                        "rank_bytes": rank_bytes,
                        "seconds": max(g[0] for g in gathered),
                        "write_s": max(g[1] for g in gathered),
                        "copied_bytes": sum(g[2] for g in gathered),
                        "estimated_s": est,
                    }
                )
                shutil.rmtree(directory)
            dist.barrier()
    return records


# -- 2. peak memory ----------------------------------------------------------------------------------
def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        assert match is not None
        return int(match.group(1)) / 1024


def memory_worker(rank: int, world: int, root: str, mode: str, quick: bool) -> float:
    state = make_state(rank, world, quick)
    full = None
    if mode == "torch.save":
        # The full state on rank 0, assembled before the measured window (the gather is not counted):
        # the other ranks' unique tensors are deterministic, so rank 0 builds them instead of receiving them.
        gathered = state["optim"]["exp_avg"].full_tensor()
        if rank == 0:
            full = {
                "model": state["model"],
                "optim": {"exp_avg": gathered, **{f"rank{r}": unique(r, quick) for r in range(world)}},
                "step": state["step"],
            }
    directory = Path(root) / mode
    gc.collect()
    dist.barrier()
    # Writing 5 to clear_refs resets this process's RSS high-water mark (VmHWM), so earlier peaks (imports,
    # building the state) cannot hide the save's.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mib("VmRSS")
    if mode == "async_save":
        # With the default (blocking) staging, async_save returns the upload Future.
        cast("Future[Any]", dcp.async_save(state, storage_writer=FileSystemWriter(directory))).result()
    elif mode == "dcp.save":
        dcp.save(state, storage_writer=FileSystemWriter(directory))
    elif mode == "lingctl":
        dcp.save(
            state,
            storage_writer=PCacheWriter(directory, buffer_bytes=BUFFER),
            planner=PCacheSavePlanner(ranks_per_node=2, chunk_bytes=CHUNK),
        )
    elif full is not None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(full, directory / "full.pt")
    peak = _status_mib("VmHWM")
    dist.barrier()
    return peak - base


# -- report ------------------------------------------------------------------------------------------
def best_runs(records: list[dict]) -> dict[tuple[str, str], dict]:
    best: dict[tuple[str, str], dict] = {}
    for r in records:
        key = (r["scenario"], r["plan"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~3 MiB state, 1 repeat: a smoke test of the script")
    ap.add_argument("--bandwidth", type=float, default=50.0, help="emulated MB/s of a full-speed node")
    ap.add_argument("--repeats", type=int, default=5, help="saves per plan and scenario; the fastest counts")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    bw = args.bandwidth * 1e6
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pcache-bench-", dir=os.environ.get("TMPDIR")) as root:
        records = run_workers(save_worker, WORLD, root, bw, repeats, args.quick, timeout=600)[0]
        memory = {mode: run_workers(memory_worker, WORLD, root, mode, args.quick, timeout=300) for mode in MEM_MODES}
    best = best_runs(records)
    state_mib = (
        sum(t.numel() for t in replicated(args.quick).values()) * 4 / MiB,
        [
            round((SHARDED[0] // (16 if args.quick else 1)) * SHARDED[1] * 4 / WORLD / MiB, 2)
            + unique_shape(r, args.quick)[0] * 256 * 4 / MiB
            for r in range(WORLD)
        ],
    )
    print(
        f"lingctl pcache vs torch DCP: torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{len(os.sched_getaffinity(0))} cores, {WORLD} gloo processes, 1 thread each"
    )
    print(
        f"state per rank: {state_mib[0]:.1f} MiB replicated ({len(model_shapes(args.quick))} fp32 tensors) + "
        f"rank-unique {', '.join(f'{m:.2f}' for m in state_mib[1])} MiB (ranks 0-3); "
        f"lingctl chunk {CHUNK // MiB} MiB, buffer {BUFFER // MiB} MiB; best of {repeats}"
    )

    # (measure, scenario, measured value, the same from the throttle alone, goal); value <= goal is met
    goals: list[tuple[str, str, float, float | None, float]] = []
    for sc in scenarios(bw):
        key = sc["key"]
        speeds = " / ".join(f"{b / 1e6:g}" for b in sc["bandwidth"])
        nodes, per = len(sc["bandwidth"]), sc["ranks_per_node"]
        streams = f", each rank one stream of {sc['rank_bandwidth'] / 1e6:g} MB/s" if "rank_bandwidth" in sc else ""
        print(f"\nsave, {nodes} nodes x {per} rank{'s' if per > 1 else ''}, node MB/s {speeds}{streams}")
        print(
            f"  {'plan':<15} {'MB per node':<28} {'bytes max/mean':>14} {'finish max/mean':>15} "
            f"{'seconds':>8} {'lingctl/this':>12}"
        )
        ling = best[(key, "lingctl")]
        for plan in PLANS:
            r = best[(key, plan)]
            nb = r["node_bytes"]
            # Busiest node over the mean, in bytes and in time the throttle needs (bytes / the node's
            # bandwidth): the two agree on equal nodes; on unequal ones a good plan evens out the time.
            finish = [b / s for b, s in zip(nb, sc["bandwidth"])]
            if "rank_bandwidth" in sc:  # a node finishes with its slowest stream, or its link if that is slower
                per_node = sc["ranks_per_node"]
                finish = [
                    max(f, max(r["rank_bytes"][n * per_node : (n + 1) * per_node]) / sc["rank_bandwidth"])
                    for n, f in enumerate(finish)
                ]
            r["bytes_max_over_mean"] = max(nb) / (sum(nb) / len(nb))
            r["finish_max_over_mean"] = max(finish) / (sum(finish) / len(finish))
            r["bound_s"] = max(finish)
            print(
                f"  {PLAN_NAMES[plan]:<15} {' / '.join(f'{b / 1e6:.1f}' for b in nb):<28} "
                f"{r['bytes_max_over_mean']:>14.3f} {r['finish_max_over_mean']:>15.3f} {r['seconds']:>8.3f} "
                f"{ling['seconds'] / r['seconds']:>12.3f}   (throttle alone: {max(finish):.3f} s)"
            )
        print(
            f"  lingctl planner's own estimate {ling['estimated_s']:.3f} s; bytes copied through its buffer "
            f"{ling['copied_bytes'] / MiB:.1f} MiB (all ranks)"
        )
        goals.append(("busiest node / mean (finish time)", key, ling["finish_max_over_mean"], None, 1.02))
        dcp_goal = {"2x2-equal": 0.9, "2x2-unequal": 0.7, "2x2-streams": 0.9}.get(key)
        if dcp_goal:
            goals.append(
                (
                    "save time lingctl / DCP default",
                    key,
                    ling["seconds"] / best[(key, "dcp")]["seconds"],
                    ling["bound_s"] / best[(key, "dcp")]["bound_s"],
                    dcp_goal,
                )
            )
        goals.append(
            (
                "save time lingctl / rank-0 writers",
                key,
                ling["seconds"] / best[(key, "rank0")]["seconds"],
                ling["bound_s"] / best[(key, "rank0")]["bound_s"],
                0.5,
            )
        )

    print("\npeak extra memory per rank during the save (VmHWM - RSS before), MiB, no throttle")
    for mode in MEM_MODES:
        print(
            f"  {mode:<12} "
            + "  ".join(f"rank {r}: {m:6.1f}" for r, m in enumerate(memory[mode]))
            + f"   max {max(memory[mode]):6.1f}"
        )
    mem_ratio = max(memory["lingctl"]) / max(memory["async_save"])
    print(f"  lingctl / async_save (max over ranks) = {mem_ratio:.3f} ({100 * (1 - mem_ratio):.0f}% below)")
    goals.append(("peak extra memory lingctl / async_save", "no throttle", mem_ratio, None, 0.4))

    print("\nsummary")
    print(f"  {'measure':<40} {'scenario':<12} {'value':>7} {'throttle alone':>14} {'goal':>8}  result")
    for measure, key, value, bound, goal in goals:
        alone = "" if bound is None else f"{bound:.3f}"
        print(
            f"  {measure:<40} {key:<12} {value:>7.3f} {alone:>14} {'<= ' + format(goal, 'g'):>8}  "
            f"{'met' if value <= goal else 'MISSED'}"
        )
    print(f"  (wall time of the whole run: {time.monotonic() - t0:.0f} s)")

    if args.json:
        report = {
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "cores": len(os.sched_getaffinity(0)),
            "world": WORLD,
            "bandwidth_mb_s": args.bandwidth,
            "repeats": repeats,
            "quick": args.quick,
            "chunk_bytes": CHUNK,
            "buffer_bytes": BUFFER,
            "replicated_mib": state_mib[0],
            "unique_mib": state_mib[1],
            "save_best": [best[k] for k in sorted(best)],
            "save_all": records,
            "memory_mib": memory,
            "goals": [
                {"measure": m, "scenario": k, "value": v, "throttle_alone": b, "goal": g, "met": v <= g}
                for m, k, v, b, g in goals
            ],
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
