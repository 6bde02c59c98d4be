"""PCacheSavePlanner + PCacheWriter in real gloo process groups: 4 ranks as 2 nodes x 2 ranks.

The state is what pure data parallelism with a sharded optimizer looks like: replicated parameters (the
same on every rank, one large enough to be split into chunks), a DTensor sharded unevenly over all ranks,
and per-rank tensors of different sizes. Checkpoints are read back with stock ``dcp.load`` and with
``pcache.load`` (its code-free reader) in one process, and resharded onto 2 and 8 processes by ``pcache.load``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lingctl.core.errors import UsageError
from lingctl.pcache.checkpoint import load as pcache_load
from lingctl.pcache.checkpoint import save as pcache_save
from lingctl.pcache.marker import MARKER, METADATA
from lingctl.pcache.save_planner import PCacheSavePlanner
from lingctl.pcache.throttle import NodeThrottle
from lingctl.pcache.writer import PCacheWriter
from tests.support.dist import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

CHUNK = 256 << 10
SHARDED = (4099, 32)  # rows do not divide by 4 or 8: uneven shards


def replicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = [(512, 256), (384, 256), (256, 256), (1024, 64), (300, 7), (64,), (64,), (2000, 128)]
    return {f"model.w{i}": torch.randn(shape, generator=g) for i, shape in enumerate(shapes)}


def sharded_full() -> torch.Tensor:
    return torch.randn(SHARDED, generator=torch.Generator().manual_seed(11))


def rank_extra(rank: int) -> torch.Tensor:
    return torch.full(((rank + 1) * 9000 + 123,), float(rank))


def _state(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state: dict = {"model": replicated(), "step": 42}
    state["optim.m"] = distribute_tensor(sharded_full(), mesh, [Shard(0)])
    state[f"rank{rank}.extra"] = rank_extra(rank)
    return state


def _die_once_writing(directory: Path, after: float) -> None:
    """SIGKILL this process ``after`` seconds once a data file exists: mid-save however slow the machine."""
    while not any(directory.glob("__*.distcp")):
        time.sleep(0.01)
    time.sleep(after)
    os.kill(os.getpid(), signal.SIGKILL)


def _save(rank: int, world: int, directory: str, slow_bps: float | None, die_after: float | None) -> dict:
    state = _state(rank, world)
    planner = PCacheSavePlanner(ranks_per_node=2, chunk_bytes=CHUNK)
    throttle = NodeThrottle(Path(directory).parent / f"node{rank // 2}.throttle", slow_bps) if slow_bps else None
    writer = PCacheWriter(directory, buffer_bytes=CHUNK, throttle=throttle)
    if die_after is not None and rank == 1:
        threading.Thread(target=_die_once_writing, args=(Path(directory), die_after), daemon=True).start()
    dcp.save(state, storage_writer=writer, planner=planner)
    return {
        "summary": planner.summary,
        "written": writer.written_bytes,
        "copied": writer.buffer.copied_bytes,
        "oversize": writer.buffer.oversize_items,
    }


def _load(rank: int, world: int, directory: str) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state: dict = {
        "model": {k: torch.zeros_like(v) for k, v in replicated().items()},
        "step": 0,
        "optim.m": distribute_tensor(torch.zeros(SHARDED), mesh, [Shard(0)]),
    }
    if rank < 4:
        state[f"rank{rank}.extra"] = torch.zeros_like(rank_extra(rank))
    pcache_load(state, directory)
    expected = distribute_tensor(sharded_full(), mesh, [Shard(0)]).to_local()
    ok_model = all(torch.equal(state["model"][k], v) for k, v in replicated().items())
    ok_extra = rank >= 4 or torch.equal(state[f"rank{rank}.extra"], rank_extra(rank))
    return {
        "model": ok_model,
        "sharded": torch.equal(state["optim.m"].to_local(), expected),
        "local_rows": state["optim.m"].to_local().shape[0],
        "extra": ok_extra,
        "step": state["step"],
    }


def _node_bytes(directory: Path) -> list[int]:
    marker = json.loads((directory / MARKER).read_text())
    nodes = [0, 0]
    for name, info in marker["files"].items():
        if name.endswith(".distcp"):
            rank = int(name.strip("_").split("_")[0])
            nodes[rank // 2] += info["size"]
    return nodes


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    directory = tmp_path_factory.mktemp("pcache") / "step-1"
    results = run_workers(_save, 4, str(directory), None, None)
    return directory, results


def test_bytes_per_node_are_balanced_within_two_percent(saved: tuple[Path, list[dict]]) -> None:
    directory, results = saved
    nodes = _node_bytes(directory)
    assert max(nodes) <= 1.02 * (sum(nodes) / 2), nodes
    summary = results[0]["summary"]
    assert summary.split_items >= 2  # the large replicated tensors went out in chunks
    assert max(summary.node_bytes) <= 1.02 * sum(summary.node_bytes) / 2
    # Every rank wrote something: the replicated bytes were spread, not left to rank 0.
    assert all(r["written"] > 0 for r in results)
    assert all(r["oversize"] == 0 for r in results)


def test_stock_dcp_load_in_one_process_equals_the_saved_state(saved: tuple[Path, list[dict]]) -> None:
    directory, _ = saved
    state: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in replicated().items()},
        "step": 0,
        "optim.m": torch.zeros(SHARDED),
        **{f"rank{r}.extra": torch.zeros_like(rank_extra(r)) for r in range(4)},
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)))
    assert state["step"] == 42
    for key, value in replicated().items():
        assert torch.equal(state["model"][key], value), key
    assert torch.equal(state["optim.m"], sharded_full())
    for r in range(4):
        assert torch.equal(state[f"rank{r}.extra"], rank_extra(r))
    again: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in replicated().items()},
        "step": 0,
        "optim.m": torch.zeros(SHARDED),
    }
    pcache_load(again, directory)  # the verified, code-free reader reads what stock DCP reads
    assert again["step"] == 42 and torch.equal(again["optim.m"], sharded_full())
    assert all(torch.equal(again["model"][k], v) for k, v in replicated().items())


@pytest.mark.parametrize("world", [2, 8])
def test_reload_reshards_onto_another_world_size(saved: tuple[Path, list[dict]], world: int) -> None:
    directory, _ = saved
    results = run_workers(_load, world, str(directory), timeout=240)
    assert all(r["model"] and r["sharded"] and r["extra"] and r["step"] == 42 for r in results), results
    assert sum(r["local_rows"] for r in results) == SHARDED[0]


def test_kill_during_save_leaves_the_previous_checkpoint_loadable(
    saved: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    previous, _ = saved
    before = {p.name: p.stat().st_mtime_ns for p in previous.iterdir()}
    broken = previous.parent / "step-2"
    # ~1 MiB per node at 0.5 MB/s: the save is well under way when rank 1 is killed.
    # The kill surfaces as the dead rank's exit, or as another rank's error when that one is seen first.
    with pytest.raises((torch.multiprocessing.ProcessExitedException, torch.multiprocessing.ProcessRaisedException)):
        run_workers(_save, 4, str(broken), 0.5e6, 0.3, timeout=60)
    assert broken.exists() and any(broken.glob("__*.distcp"))  # it had started writing
    assert not (broken / MARKER).exists() and not (broken / METADATA).exists()
    assert {p.name: p.stat().st_mtime_ns for p in previous.iterdir()} == before
    state: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in replicated().items()}, "step": 0}
    dcp.load(state, checkpoint_id=str(previous))
    assert state["step"] == 42 and all(torch.equal(state["model"][k], v) for k, v in replicated().items())
    # A second attempt at the same directory clears the leftovers and commits.
    run_workers(_save, 4, str(broken), None, None)
    assert (broken / MARKER).exists()
    names = set(json.loads((broken / MARKER).read_text())["files"])
    assert {p.name for p in broken.iterdir() if not p.name.startswith(".pcache")} - {MARKER} == names


def test_a_committed_checkpoint_is_never_overwritten(saved: tuple[Path, list[dict]]) -> None:
    directory, _ = saved
    before = (directory / MARKER).read_bytes()
    with pytest.raises(UsageError, match="already holds a committed checkpoint"):
        pcache_save({"x": torch.zeros(3)}, directory)
    assert (directory / MARKER).read_bytes() == before
