"""``pcache.load`` never runs code from a checkpoint and never reads a byte its marker does not vouch for.

Forgeries here are consistent (the marker's entry is rewritten to match the planted file), as an attacker
who can write both would make them: the checksum passes, and the restricted readers must still refuse.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import EXIT_VERIFY, VerificationError
from lingctl.core.names import UnsafeNameError
from lingctl.pcache.checkpoint import load, save
from lingctl.pcache.safe_reader import SafeReader, load_metadata
from tests.pcache.tier_fixtures import flip_byte

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCommand:
    """Unpickled by a plain ``pickle.load``, this runs a shell command that creates ``sentinel``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


class RunsExec:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.sentinel)!r}, 'w').close()",)


def _state() -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "opt": {"step": 5, "m": torch.ones(4)}}


def _template() -> dict:
    return {"w": torch.zeros(3, 4), "opt": {"step": 0, "m": torch.zeros(4)}}


def _plant(directory: Path, name: str, data: bytes) -> None:
    """Replace ``name`` and rewrite its marker entry to match: a forgery the checksums cannot catch."""
    (directory / name).write_bytes(data)
    marker_path = directory / "pcache.json"
    marker = json.loads(marker_path.read_text())
    marker["files"][name] = {"size": len(data), "crc64nvme": crc64_bytes(data).tagged()}
    marker_path.write_text(json.dumps(marker))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return Path(save(_state(), tmp_path / "step-1").local_dir)


def test_a_saved_checkpoint_loads_back(checkpoint: Path) -> None:
    back = _template()
    load(back, checkpoint)
    assert torch.equal(back["w"], _state()["w"]) and back["opt"]["step"] == 5


@pytest.mark.parametrize("payload", ["system", "exec", "inside-metadata"])
def test_metadata_that_would_run_code_is_refused_and_runs_nothing(
    checkpoint: Path, tmp_path: Path, payload: str
) -> None:
    sentinel = tmp_path / "SENTINEL"
    if payload == "inside-metadata":  # a genuine Metadata object carrying the payload in a field
        metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
        metadata.planner_data = {"x": RunsCommand(sentinel)}
        crafted = pickle.dumps(metadata)
    else:
        crafted = pickle.dumps((RunsCommand if payload == "system" else RunsExec)(sentinel))
    _plant(checkpoint, ".metadata", crafted)
    with pytest.raises(VerificationError, match=r"\.metadata: refers to (posix|builtins)\.(system|exec)") as exc:
        load(_template(), checkpoint)
    assert exc.value.exit_code == EXIT_VERIFY and "\n" not in str(exc.value)
    assert not sentinel.exists()


def test_a_non_tensor_item_that_would_run_code_is_refused(tmp_path: Path) -> None:
    sentinel = tmp_path / "SENTINEL"
    # The writer itself records it faithfully (marker and all): only the reader can refuse it.
    directory = Path(save({"w": torch.ones(3), "evil": RunsCommand(sentinel)}, tmp_path / "c").local_dir)
    assert not sentinel.exists()
    refused = r"__0_0\.distcp: item 'evil' is not plain data \(Trying to load unsupported GLOBAL posix\.system"
    with pytest.raises(VerificationError, match=refused) as exc:
        load({"w": torch.zeros(3), "evil": None}, directory)
    assert exc.value.exit_code == EXIT_VERIFY and "\n" not in str(exc.value)
    assert not sentinel.exists()


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_flipped_byte_is_refused_naming_the_file(checkpoint: Path, name: str) -> None:
    flip_byte(checkpoint / name, offset=40)
    with pytest.raises(VerificationError, match=rf"{name}: checksum .* refusing to load it") as exc:
        load(_template(), checkpoint)
    assert exc.value.exit_code == EXIT_VERIFY


def test_metadata_pointing_outside_the_marker_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((checkpoint / "__0_0.distcp").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    _plant(checkpoint, ".metadata", pickle.dumps(metadata))
    with pytest.raises(UnsafeNameError, match=r"data file: '\.\./outside\.distcp'"):
        load(_template(), checkpoint)
    for info in metadata.storage_data.values():
        info.relative_path = "unlisted.distcp"
    (checkpoint / "unlisted.distcp").write_bytes(outside.read_bytes())
    _plant(checkpoint, ".metadata", pickle.dumps(metadata))
    with pytest.raises(VerificationError, match="points at 'unlisted.distcp', which pcache.json does not list"):
        load(_template(), checkpoint)


def test_a_marker_without_metadata_or_its_checksum_is_refused(checkpoint: Path) -> None:
    marker_path = checkpoint / "pcache.json"
    marker = json.loads(marker_path.read_text())
    del marker["files"][".metadata"]["crc64nvme"]
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(VerificationError, match="records no checksum"):
        load(_template(), checkpoint)
    del marker["files"][".metadata"]
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(VerificationError, match=r"\.metadata: not listed in pcache.json"):
        load(_template(), checkpoint)


def test_garbage_metadata_is_one_verification_error() -> None:
    for data in (b"", b"\x80\x05garbage", pickle.dumps({"not": "metadata"}), pickle.dumps([1] * 3)):
        with pytest.raises(VerificationError, match="x/.metadata: ") as exc:
            load_metadata(data, "x/.metadata")
        assert "\n" not in str(exc.value)


def test_stock_dcp_checkpoints_read_through_the_safe_reader(tmp_path: Path) -> None:
    state = {**_state(), "names": ["a", "b"], "lr": 0.5}
    dcp.save(state, checkpoint_id=str(tmp_path / "stock"))  # DCP's own writer: no marker, stock metadata
    back = {**_template(), "names": [], "lr": 0.0}
    dcp.load(back, storage_reader=SafeReader(tmp_path / "stock"))
    assert torch.equal(back["w"], state["w"]) and back["names"] == ["a", "b"] and back["lr"] == 0.5
    # pcache.load itself reads only checkpoints whose marker vouches for every file.
    with pytest.raises(VerificationError, match="incomplete checkpoint"):
        load(_template(), tmp_path / "stock")
