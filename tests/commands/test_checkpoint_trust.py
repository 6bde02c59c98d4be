"""`lingctl train --resume` from a tampered run directory: refused with exit 4 and one line, and nothing runs.

The attacker here can write the checkpoint and its marker (pcache.json) alike, so the planted ``.metadata``
passes its checksum: what stops it is the restricted unpickler. The refusals come before any training, so the
CLI runs in this process (a payload that did run would touch the sentinel from here just the same).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

from lingctl.cli import run as cli_run
from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import EXIT_VERIFY
from tests.pcache.tier_fixtures import flip_byte

TINY = ("train", "--preset", "tiny", "--eval-every", "0")


class RunsCommand:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _set_entry(state: Path, name: str, data: bytes) -> None:
    marker = json.loads((state / "pcache.json").read_text())
    marker["files"][name] = {"size": len(data), "crc64nvme": crc64_bytes(data).tagged()}
    (state / "pcache.json").write_text(json.dumps(marker))


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("lingctl: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_resume_refuses_a_tampered_checkpoint_and_runs_nothing(capsys, tmp_path, text_corpus, small_run):
    run, sentinel = tmp_path / "run", tmp_path / "SENTINEL"
    shutil.copytree(small_run, run)  # a finished 2-step run, checkpoint at step 2
    common = (*TINY, "--data", str(text_corpus), "--out", str(run), "--save-every", "2")
    state = run / json.loads((run / "latest.json").read_text())["path"] / "state"
    metadata, marker = (state / ".metadata").read_bytes(), (state / "pcache.json").read_bytes()

    crafted = pickle.dumps(RunsCommand(sentinel))
    (state / ".metadata").write_bytes(crafted)
    _set_entry(state, ".metadata", crafted)
    code, err = cli_run([*common, "--steps", "4", "--resume"]), capsys.readouterr().err
    assert code == EXIT_VERIFY, err
    line = _one_line_error(err)
    assert ".metadata" in line and "refusing to load it" in line
    assert not sentinel.exists()

    (state / ".metadata").write_bytes(metadata)
    (state / "pcache.json").write_bytes(marker)
    [data_file] = state.glob("__0_0.distcp")
    flip_byte(data_file, offset=data_file.stat().st_size // 2)
    code, err = cli_run([*common, "--steps", "4", "--resume"]), capsys.readouterr().err
    assert code == EXIT_VERIFY, err
    assert "__0_0.distcp: checksum" in _one_line_error(err)
    assert json.loads((run / "latest.json").read_text())["step"] == 2  # nothing was trained on either
