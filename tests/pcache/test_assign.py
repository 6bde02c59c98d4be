"""The placement rule: exactly one-at-a-time greedy (checked against a brute force), fast blocks, row cuts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lingctl.core.errors import UsageError
from lingctl.pcache.assign import fill, place, split_rows
from lingctl.pcache.topology import Topology, parse_bandwidth, parse_rank_map


def _greedy_counts(loads: list[float], speeds: list[float], size: float, count: int) -> list[int]:
    loads = list(loads)
    counts = [0] * len(loads)
    for _ in range(count):
        n = min(range(len(loads)), key=lambda i: ((loads[i] + size) / speeds[i], i))
        counts[n] += 1
        loads[n] += size
    return counts


def _greedy_place(sizes: list[int], groups: list[int], sets: list[list[int]], topo: Topology) -> list[float]:
    rank_load = [0.0] * topo.world_size
    node_load = [0.0] * topo.num_nodes
    for s, g in zip(sizes, groups):
        if len(sets[g]) == 1:
            rank_load[sets[g][0]] += s
            node_load[topo.rank_nodes[sets[g][0]]] += s
    order = sorted((i for i in range(len(sizes)) if len(sets[groups[i]]) > 1), key=lambda i: (-sizes[i], groups[i], i))
    for i in order:
        s, holders = sizes[i], sets[groups[i]]
        nodes = sorted({topo.rank_nodes[r] for r in holders})
        n = min(nodes, key=lambda k: ((node_load[k] + s) / topo.node_bandwidth[k], k))
        r = min((r for r in holders if topo.rank_nodes[r] == n), key=lambda x: (rank_load[x], x))
        rank_load[r] += s
        node_load[n] += s
    return rank_load


def test_fill_equals_one_at_a_time_greedy() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        m = rng.randint(1, 9)
        speeds = [rng.choice([0.5, 1.0, 1.7, 2.0, 3.0]) for _ in range(m)]
        loads = [float(rng.randint(0, 50) * rng.choice([1, 7, 64])) for _ in range(m)]
        size, count = float(rng.choice([1, 3, 7, 64, 100])), rng.randint(0, 200)
        assert fill(list(loads), speeds, size, count) == _greedy_counts(loads, speeds, size, count)


def test_place_equals_one_at_a_time_greedy() -> None:
    rng = random.Random(1)
    for _ in range(300):
        nodes, per = rng.randint(1, 4), rng.randint(1, 3)
        topo = Topology.uniform(nodes, per, [rng.choice([1.0, 2.0, 3.0]) for _ in range(nodes)])
        sets = [
            sorted(set(rng.sample(range(topo.world_size), rng.randint(1, topo.world_size))))
            for _ in range(rng.randint(1, 4))
        ]
        n = rng.randint(0, 300)
        sizes = [rng.choice([1, 2, 5, 8, 100]) for _ in range(n)]
        groups = [rng.randrange(len(sets)) for _ in range(n)]
        placement = place(sizes, groups, sets, topo)
        assert placement.rank_bytes == [int(x) for x in _greedy_place(sizes, groups, sets, topo)]
        for i, w in enumerate(placement.writers.tolist()):
            assert w in sets[groups[i]]


def test_unique_items_stay_with_their_holder_and_replicas_fill_around_them() -> None:
    topo = Topology.uniform(2, 2)
    sets = [[0], [1], [2], [3], [0, 1, 2, 3]]
    sizes = [900, 100, 0, 0] + [10] * 100
    placement = place(sizes, [0, 1, 2, 3] + [4] * 100, sets, topo)
    assert placement.writers[:2].tolist() == [0, 1]
    assert placement.node_bytes == [1000, 1000]


def test_bytes_follow_bandwidth_on_unequal_nodes() -> None:
    topo = Topology.uniform(3, 2, [3e9, 2e9, 1e9])
    placement = place([1 << 20] * 6000, [0] * 6000, [list(range(6))], topo)
    total = sum(placement.node_bytes)
    for got, share in zip(placement.node_bytes, [3 / 6, 2 / 6, 1 / 6]):
        assert abs(got / total - share) < 0.002


def test_row_cuts_even_out_what_list_scheduling_leaves() -> None:
    topo = Topology.uniform(2, 1)
    sizes, rows = [400, 300, 300], [40, 30, 30]  # greedy alone: 400+0 vs 300+300 -> 700 / 300 apart
    plain = place(sizes, [0] * 3, [[0, 1]], topo)
    assert max(plain.node_bytes) == 600
    even = place(sizes, [0] * 3, [[0, 1]], topo, rows=rows)
    assert even.node_bytes == [500, 500]
    # The cut rows are a tail range of an item written by the busier node, handed to the other.
    ((item, start, count, writer),) = even.cuts
    assert (
        even.kept_rows is not None
        and even.kept_rows[item] == start
        and writer != even.writers[item]
        and count * 10 == 100
    )


def test_a_million_items_plan(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    # Each holder set spans 8 nodes, half of them slow.
    topo = Topology.uniform(64, 8, [1e9 if (i // 8) % 2 else 2e9 for i in range(64)])
    sets = [list(range(g, 512, 64)) for g in range(64)]
    rng = np.random.default_rng(0)
    sizes = rng.choice([4096, 1 << 20, 3 << 20, 22 << 20], size=1_000_000)
    groups = rng.integers(0, 64, size=1_000_000)
    t = time.perf_counter()
    placement = place(sizes, groups, sets, topo)
    elapsed = time.perf_counter() - t
    assert sum(placement.node_bytes) == int(sizes.sum())
    bound = sizes.sum() / sum(topo.node_bandwidth)
    assert placement.seconds(topo) <= 1.01 * bound
    with capsys.disabled():
        print(f"\n1M items placed in {elapsed:.2f} s")


def test_split_rows() -> None:
    assert split_rows([10, 4], 4, 1000) == [(0, 10)]
    assert split_rows([10, 4], 4, 40) == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 2)]
    assert split_rows([7, 4], 4, 48) == [(0, 3), (3, 3), (6, 1)] or sum(r for _, r in split_rows([7, 4], 4, 48)) == 7
    assert split_rows([], 4, 1) == [(0, 1)]


def test_topology_input_errors_are_one_line() -> None:
    with pytest.raises(UsageError, match="2 bandwidth value"):
        Topology.uniform(3, 2, [1.0, 2.0])
    with pytest.raises(UsageError, match="node 1 has no ranks"):
        Topology.from_map([0, 0, 2, 2])
    with pytest.raises(UsageError, match="not a number"):
        parse_bandwidth("2,fast")
    with pytest.raises(UsageError, match="must be positive"):
        parse_bandwidth("2,0")
    with pytest.raises(UsageError, match="not a list of node indexes"):
        parse_rank_map("0,a")
    assert parse_rank_map("0,0,1,1") == [0, 0, 1, 1]
    with pytest.raises(UsageError, match="--ranks-per-node"):
        Topology.uniform(2, 0)
