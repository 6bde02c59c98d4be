"""The writer's staging buffer, the emulated bandwidth pipes, and a single-process save/load round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lingctl.core.checksum import crc64_file
from lingctl.core.errors import UsageError, VerificationError
from lingctl.pcache.checkpoint import load, save
from lingctl.pcache.marker import MARKER, METADATA, sidecar_name
from lingctl.pcache.throttle import NodeThrottle, Throttles
from lingctl.pcache.topology import Topology
from lingctl.pcache.writer import StagingBuffer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _exact(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_contiguous_tensors_and_row_chunks_are_written_without_a_copy() -> None:
    buf = StagingBuffer(1 << 10)
    whole = torch.randn(64, 8)
    rows = torch.randn(100, 8, dtype=torch.bfloat16)[10:20]  # a row chunk: its storage is the whole tensor
    for t in (whole, rows, torch.tensor(3.0)):
        staged = buf.stage(t)
        assert torch.equal(staged, t) and _exact(staged)
        assert staged.data_ptr() == t.data_ptr()  # the live memory itself
    assert buf.copied_bytes == 0


def test_strided_tensors_go_through_the_one_buffer_and_oversize_ones_are_counted() -> None:
    buf = StagingBuffer(1 << 12)
    strided = torch.randn(16, 16).t()  # 1 KiB, not contiguous
    staged = buf.stage(strided)
    assert torch.equal(staged, strided) and _exact(staged) and staged.is_contiguous()
    again = buf.stage(torch.randn(8, 8).t())
    assert again.data_ptr() == staged.data_ptr()  # the same buffer is reused
    assert buf.copied_bytes == 1024 + 256 and buf.oversize_items == 0
    big = torch.randn(64, 64).t()  # 16 KiB > the 4 KiB buffer
    assert torch.equal(buf.stage(big), big) and buf.oversize_items == 1


def test_pipes_book_back_to_back_intervals(tmp_path: Path) -> None:
    a = NodeThrottle(tmp_path / "node0", 1e6, depth=0)
    b = NodeThrottle(tmp_path / "node0", 1e6, depth=0)  # another writer of the same node
    first = a.reserve(500_000)
    second = b.reserve(250_000)
    assert second == pytest.approx(first + 0.25, abs=1e-9)  # it queues behind the first writer's bytes
    other = NodeThrottle(tmp_path / "node1", 1e6, depth=0)
    assert other.reserve(1000) < first  # another node's pipe is free
    both = Throttles(NodeThrottle(tmp_path / "link", 1e9, depth=0), NodeThrottle(tmp_path / "stream", 1e9, depth=0))
    both.consume(1000)
    both.drain()
    assert all(p.waited_s >= 0 for p in both.pipes)
    for t in (a, b, other):
        t.close()
    both.close()


def test_save_commits_a_marker_that_lists_every_file_and_load_reads_it_back(tmp_path: Path) -> None:
    state: dict[str, Any] = {
        "w": torch.randn(300, 40),
        "b": torch.randn(40),
        "opt": {"step": 7, "m": torch.randn(5, 5)},
    }
    result = save(state, tmp_path / "step-1", chunk_bytes=8 << 10, buffer_bytes=8 << 10, extra={"step": 1})
    directory = Path(result.local_dir)
    marker = json.loads((directory / MARKER).read_text())
    assert marker["format"] == "lingctl-pcache" and marker["step"] == 1 and marker["world_size"] == 1
    assert set(marker["files"]) == {"__0_0.distcp", sidecar_name(0), METADATA}
    for name, info in marker["files"].items():
        assert (directory / name).stat().st_size == info["size"]
        assert crc64_file(directory / name).tagged() == info["crc64nvme"]
    assert marker["plan"]["items"] > 4  # the 48 KB tensor went out in 8 KiB chunks
    back: dict[str, Any] = {"w": torch.zeros(300, 40), "b": torch.zeros(40), "opt": {"step": 0, "m": torch.zeros(5, 5)}}
    load(back, directory)
    assert torch.equal(back["w"], state["w"]) and back["opt"]["step"] == 7
    # Stock DCP reads it too.
    plain = {"w": torch.zeros(300, 40)}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(directory)))
    assert torch.equal(plain["w"], state["w"])


def test_an_incomplete_directory_is_refused_by_load(tmp_path: Path) -> None:
    save({"w": torch.ones(4)}, tmp_path / "c")
    (tmp_path / "c" / MARKER).unlink()  # as a crash between the data and the commit leaves it
    with pytest.raises(VerificationError, match="incomplete checkpoint"):
        load({"w": torch.zeros(4)}, tmp_path / "c")


def test_a_topology_that_does_not_fit_the_job_is_a_one_line_error_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="the topology has 4 ranks but the checkpoint is saved by 1"):
        save({"w": torch.ones(4)}, tmp_path / "c", topology=Topology.uniform(2, 2))
    assert not (tmp_path / "c").exists()
    with pytest.raises(UsageError, match="2 bandwidth value"):
        save({"w": torch.ones(4)}, tmp_path / "c", node_bandwidth=[1e9, 2e9])
