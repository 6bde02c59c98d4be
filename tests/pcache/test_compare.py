"""The four strategies: bytes conserved, DCP's planner reproduced exactly, the lingctl plan balanced."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lingctl.core.errors import UsageError
from lingctl.pcache.assign import split_rows
from lingctl.pcache.compare import compare
from lingctl.pcache.layout import Items, Parallelism, write_items
from lingctl.pcache.model_tensors import load_model
from lingctl.pcache.plan import PlanSettings, plan
from lingctl.pcache.strategies import chunk_items, dcp_writers, lowest_writers
from lingctl.pcache.topology import Topology

log = logging.getLogger(__name__)
MIB = 2**20
_DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def torch_writers(items: Items, world: int, lowest: bool = False) -> np.ndarray:
    """The writer of each item according to torch's own dedup_save_plans, on SavePlans holding real
    WriteItems: rank r's plan lists the items it holds in state-dict order, each sized as DCP sizes a
    DTensor shard (``size`` is the whole tensor's)."""
    plans: list[list[WriteItem]] = [[] for _ in range(world)]
    for i in range(len(items)):
        itemsize = int(items.itemsize[i])
        whole = torch.Size([int(items.tensor_sizes[i]) // itemsize])
        item = WriteItem(
            index=MetadataIndex(items.names[i], [0]),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=whole),
                properties=TensorProperties(dtype=_DTYPES[itemsize]),
                size=whole,
            ),
        )
        for r in items.holders(i):
            plans[r].append(item)
    out = np.full(len(items), -1, dtype=np.int64)
    index = {name: i for i, name in enumerate(items.names)}
    for r, p in enumerate(dedup_save_plans([SavePlan(items=p) for p in plans], save_to_lowest_rank=lowest)):
        for item in p.items:
            assert out[index[item.index.fqn]] == -1
            out[index[item.index.fqn]] = r
    return out


def random_items(seed: int, world: int, n: int) -> Items:
    rng = random.Random(seed)
    sets = [
        tuple(sorted(rng.sample(range(world), min(world, rng.choice([1, 2, 3, 5, world // 2, world])))))
        for _ in range(12)
    ]
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    groups: list[int] = []
    itemsize: list[int] = []
    whole: list[int] = []
    while len(names) < n:
        # Runs of equal items in one holder set (a layer's experts), of every length, with ties.
        run, g, rows, size = (
            rng.choice([1, 1, 2, 7, 40, 300]),
            rng.randrange(len(sets)),
            rng.choice([1, 3, 64]),
            rng.choice([2, 4]),
        )
        for _ in range(run):
            names.append(f"t{len(names)}")
            shapes.append((rows, 16))
            groups.append(g)
            itemsize.append(size)
            whole.append(rows * 16 * size * rng.choice([1, 1, 4]))
    sizes = [s[0] * s[1] * k for s, k in zip(shapes, itemsize)]
    return Items(
        names=names,
        shapes=shapes,
        sizes=np.array(sizes),
        tensor_sizes=np.array(whole),
        itemsize=np.array(itemsize),
        kinds=np.zeros(len(names), dtype=np.int8),
        groups=np.array(groups),
        holder_sets=sets,
    )


@pytest.mark.parametrize("seed,world", [(0, 4), (1, 40), (2, 130)])
def test_dcp_default_matches_torch_dedup_save_plans(seed, world):
    items = random_items(seed, world, 1500)
    assert np.array_equal(dcp_writers(items), torch_writers(items, world))
    assert np.array_equal(lowest_writers(items), torch_writers(items, world, lowest=True))


def test_dcp_default_matches_torch_on_a_model_layout():
    items = write_items(load_model("small"), Parallelism(tp=2, pp=2, dp=4, ep=2), optimizer="adamw", dtype="bfloat16")
    assert np.array_equal(dcp_writers(items), torch_writers(items, 16))


def test_chunks_are_split_rows():
    items = random_items(3, 8, 300)
    items.shapes[:4] = [(), (0, 5), (1, 1 << 20), (7,)]
    items.sizes[:4] = [4, 0, 4 << 20, 28]
    for max_bytes in (64, 1000, 4 << 10, 1 << 30):
        chunks = chunk_items(items, max_bytes)
        got: list[list[tuple[int, int]]] = [[] for _ in range(len(items))]
        for p, s, r in zip(chunks.parent.tolist(), chunks.start.tolist(), chunks.rows.tolist()):
            got[p].append((s, r))
        for i, shape in enumerate(items.shapes):
            assert got[i] == split_rows(shape, int(items.itemsize[i]), max_bytes), (shape, max_bytes)
        assert np.array_equal(np.bincount(chunks.parent, weights=chunks.sizes, minlength=len(items)), items.sizes)


def run(model="small", nodes=2, ranks=2, **kw):
    return plan(PlanSettings(model=model, nodes=nodes, ranks_per_node=ranks, **kw))


def test_every_item_written_once_by_a_holder():
    items = write_items(load_model("small"), Parallelism(tp=2, dp=4, ep=2, shard_optimizer=True), "adamw")
    topology = Topology.uniform(2, 4)
    result = compare(items, topology, chunk_bytes=MIB, buffer_bytes=MIB, list_items=True)
    total = int(items.sizes.sum())
    assert [s.total_bytes for s in result.strategies] == [total] * 4
    assert sum(r.bytes["lingctl"] for r in result.ranks) == total
    assert result.write_items is not None
    for i, entry in enumerate(result.write_items):
        holders = items.holders(i)
        assert entry["rank0"] == holders[0] and entry["dcp"] in holders
        assert all(rank in holders for _, _, rank in entry["lingctl"])
        assert sum(n for _, n, _ in entry["lingctl"]) == (items.shapes[i][0] if items.shapes[i] else 1)


def test_rank0_writes_every_replicated_byte_on_the_lowest_rank():
    report = run(optimizer="adamw")
    rank0 = report.strategy("rank0")
    assert [r.bytes["rank0"] for r in report.ranks] == [report.total_bytes, 0, 0, 0]
    assert rank0.node_ratio == pytest.approx(2.0)
    # async_save stages everything the rank holds: the whole state on every rank in pure DP.
    assert rank0.staging_async_bytes == report.total_bytes == report.ranks[3].held_bytes


def test_lingctl_balances_pure_dp_nodes():
    report = run(optimizer="adamw")
    ours, bound = report.strategy("lingctl"), report.strategy("bound")
    assert ours.node_ratio <= 1.02
    assert ours.seconds >= bound.seconds and ours.vs_bound <= 1.02
    assert ours.staging_bytes <= 64 * MIB
    for s in report.strategies:
        assert s.seconds >= bound.seconds * (1 - 1e-12)


def test_unequal_bandwidth_gets_proportional_bytes():
    report = run(optimizer="adamw", node_bandwidth="3,1", chunk_mb=1)
    fast, slow = report.strategy("lingctl").node_bytes
    assert fast / slow == pytest.approx(3.0, rel=0.03)
    assert report.strategy("lingctl").vs_bound <= 1.02
    # DCP knows nothing of bandwidth: the slow node gets about half, so it takes ~2x the bound.
    assert report.strategy("dcp").vs_bound > 1.6


def test_bound_counts_bytes_only_one_node_can_write():
    # Sharded optimizer, pure DP: 3/4 of adamw's bytes (fp32 states of a bf16 model) are rank-unique.
    report = run(optimizer="adamw", dtype="bfloat16", shard_optimizer=True, node_bandwidth="1,4")
    bound = report.strategy("bound")
    assert bound.seconds > report.total_bytes / 5e9 * 1.5
    assert report.strategy("lingctl").seconds >= bound.seconds


def test_a_million_items_plan(record_property):
    report = run(model="ling-plus", nodes=16, ranks=8, tp=8, pp=8, dp=2, ep=2, chunk_mb=3.5)
    assert report.chunks >= 1_000_000
    assert report.strategy("lingctl").vs_bound < 1.01
    # Recorded, not asserted (shared CI cores): well under a second on 2 cores when measured.
    record_property("plan_seconds", report.plan_seconds)
    log.info("%d chunks planned in %.3f s", report.chunks, report.plan_seconds)
    assert report.plan_seconds > 0


def test_world_must_match_parallelism():
    with pytest.raises(UsageError, match=r"4 ranks, but tp 2 x pp 1 x dp 4 = 8"):
        run(tp=2, dp=4)
    with pytest.raises(UsageError, match="3 bandwidth value"):
        run(node_bandwidth="1,2,3")


def test_the_library_does_not_load_rich():
    # The plan is a record; `lingctl pcache` draws it. A fresh interpreter, since this one has Rich loaded.
    code = (
        "import sys, lingctl.pcache.compare; print(sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'typer'}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
