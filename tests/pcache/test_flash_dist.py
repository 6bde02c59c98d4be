"""The flash tier end to end: 4 gloo ranks as 2 nodes, each node with its own cache directory (its "local
disk"), saving to a real S3 server; then reads from S3 on 2 ranks and from a node's partial local copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lingctl.babel.verify import verify
from lingctl.core.storage import S3Options, parse_url
from lingctl.pcache.checkpoint import load, save
from lingctl.pcache.tier import Uploader
from lingctl.pcache.tier_status import status
from tests.support.dist import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(3)
    model = {f"layer{i}.w": torch.randn(256, 64 * (i + 1), generator=g) for i in range(5)}
    return {"model": model, "step": 9, f"rank{rank}.m": torch.full((1000 * (rank + 1),), float(rank))}


def _save(rank: int, world: int, url: str, cache_root: str) -> dict:
    uploader = Uploader()
    durable: list[str] = []
    result = save(
        _state(rank),
        url,
        cache_dir=Path(cache_root) / f"node{rank // 2}",
        uploader=uploader,
        ranks_per_node=2,
        chunk_bytes=64 << 10,
        buffer_bytes=64 << 10,
        on_durable=durable.append,
    )
    uploader.wait(timeout=120)
    uploader.close()
    return {"local": result.local_dir, "written": result.written_bytes, "durable": durable}


def _load(rank: int, world: int, url: str, cache_dir: str) -> bool:
    target: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in _state(0)["model"].items()},
        "step": 0,
        f"rank{rank}.m": torch.zeros(1000 * (rank + 1)),
    }
    load(target, url, cache_dir=cache_dir)
    expected = _state(rank)
    return (
        target["step"] == 9
        and all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())
        and torch.equal(target[f"rank{rank}.m"], expected[f"rank{rank}.m"])
    )


def test_each_node_uploads_its_own_files_and_the_result_verifies(
    tmp_path: Path, s3_bucket: str, s3_env: dict[str, str]
) -> None:
    url = f"s3://{s3_bucket}/run/step-9"
    results = run_workers(_save, 4, url, str(tmp_path / "cache"), timeout=180)
    assert results[0]["durable"] == [url] and all(not r["durable"] for r in results[1:])
    assert all(r["written"] > 0 for r in results)  # the replicated layers were spread over all ranks
    node0, node1 = Path(results[0]["local"]), Path(results[2]["local"])
    assert node0 != node1
    # Each node's disk holds only its own ranks' data; the marker is on the coordinator's node.
    assert sorted(p.name for p in node0.glob("__*_0.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in node1.glob("__*_0.distcp")) == ["__2_0.distcp", "__3_0.distcp"]
    assert (node0 / "pcache.json").exists() and not (node1 / "pcache.json").exists()
    [row] = status(node0)
    assert row.state == "durable", row
    # The store holds every file the marker lists, byte for byte the same as the nodes' copies.
    marker = json.loads((node0 / "pcache.json").read_text())
    s3 = S3Options()
    for node in (node0, node1):
        result = verify(parse_url(str(node)), parse_url(url), s3, mode="full")
        # The other node's files are "only in destination"; nothing may be missing or differ.
        assert [d for d in result.differences if d["problem"] != "only in destination"] == [], result.differences
        assert result.matched >= 4
    on_nodes = {p.name for p in node0.iterdir()} | {p.name for p in node1.iterdir()}
    assert set(marker["files"]) | {"pcache.json"} == on_nodes
    # A fresh node (empty cache) reads it from the store on 2 ranks.
    assert all(run_workers(_load, 2, url, str(tmp_path / "fresh"), timeout=120))
    # Node 1's own copy lacks the marker and ranks 0-1's files: the read fetches only what is missing.
    assert all(run_workers(_load, 2, url, str(tmp_path / "cache" / "node1"), timeout=120))
    assert (node1 / "pcache.json").exists() and (node1 / "__0_0.distcp").exists()
