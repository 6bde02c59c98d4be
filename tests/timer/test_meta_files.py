"""Meta files that the tracer did not write: `timer diagnose` and `timer export` skip each with one warning
naming it, go on with the other ranks, and exit 4 with one line naming a file when no meta file is usable.
Never a traceback or an internal error, whatever the types, sizes or shape of what is in the file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lingctl.cli import run as cli_run
from lingctl.timer.logs import INT32_MAX, MAX_WORLD
from tests.timer.test_diagnose import steps
from tests.timer.test_export import write_run

GOOD: dict[str, Any] = {
    "pid": 4242,
    "rank": 1,
    "world": 2,
    "local_rank": 1,
    "argv": "train.py",
    "hostname": "elsewhere",
    "log": "rank-1.4242.trace.zst",
    "mono_anchor_ns": 0,
    "wall_anchor_ns": 0,
    "groups": {"0": 0},
}


def changed(**fields: Any) -> str:
    meta = {k: v for k, v in {**GOOD, **fields}.items() if v is not ...}  # ``...``: leave the field out
    return json.dumps(meta)


# (case, file content, the reason given after the file's name)
BAD: list[tuple[str, str | bytes, str]] = [
    ("pid-string", changed(pid="12"), 'pid is "12"; expected a process id'),
    ("pid-float", changed(pid=12.0), "pid is 12.0; expected a process id"),
    ("pid-negative", changed(pid=-5), "pid is -5; expected a process id"),
    ("pid-huge", changed(pid=10**30), f"pid is {10**30}; expected a process id (an integer from 1 to {INT32_MAX})"),
    ("pid-missing", changed(pid=...), "pid is missing; expected a process id"),
    ("rank-list", changed(rank=[1]), "rank is [1]; expected a rank"),
    ("rank-bool", changed(rank=True), "rank is true; expected a rank"),
    ("world-zero", changed(world=0), "world is 0; expected a world size"),
    ("world-huge", changed(world=MAX_WORLD + 1), f"world is {MAX_WORLD + 1}; expected a world size"),
    ("world-nan", changed(world=1).replace('"world": 1', '"world": NaN'), "world is NaN; expected a world size"),
    ("anchor-huge", changed(mono_anchor_ns=2**70), "mono_anchor_ns is 1180591620717411303424; expected a clock"),
    ("anchor-string", changed(wall_anchor_ns="now"), 'wall_anchor_ns is "now"; expected a clock'),
    ("groups-list", changed(groups=[0]), "groups is [0]; expected an object of group name -> slot"),
    ("groups-slot", changed(groups={"0": 99}), 'groups is {"0": 99}; expected an object of group name -> slot'),
    ("log-number", changed(log=5), "log is 5; expected the log's file name"),
    ("log-outside", changed(log="../../etc/passwd"), "log: '../../etc/passwd' has an empty, '.' or '..' segment"),
    ("hostname-list", changed(hostname=["a"]), 'hostname is ["a"]; expected a host name'),
    ("array", "[1, 2]", "not a JSON object (a JSON array)"),
    ("string", '"rank"', "not a JSON object (a JSON string)"),
    ("truncated", changed()[:20], "not JSON (Expecting ':' delimiter at line 1)"),
    ("deep", "[" * 100_000 + "]" * 100_000, "not JSON lingctl writes"),
    ("long-number", changed().replace('"pid": 4242', '"pid": ' + "7" * 5000), "not JSON lingctl writes"),
    ("binary", b"\xff\xfe\x00garbage", "not UTF-8 text"),
]


def plant(out: Path, content: str | bytes, n: int = 0) -> Path:
    path = out / f"rank-1.{4242 + n}.meta.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def skipped_paths(stderr: str) -> list[str]:
    """The files named by the ``skipping PATH: why`` warnings, in order; fails on any other line."""
    prefix = "lingctl: WARNING lingctl.timer: skipping "
    lines = stderr.splitlines()
    assert all(line.startswith(prefix) for line in lines), lines
    return [line.removeprefix(prefix).split(": ", 1)[0] for line in lines]


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_run(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.parametrize("content, why", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_malformed_meta_file_alone_is_exit_4_naming_it(capsys, tmp_path: Path, content: str, why: str) -> None:
    path = plant(tmp_path, content)
    for args in (["timer", "diagnose", str(tmp_path)], ["timer", "export", str(tmp_path), "-o", str(tmp_path / "t")]):
        code, out, err = cli(capsys, *args)
        lines = err.splitlines()
        assert code == 4, (args, err)
        assert lines[0].startswith(f"lingctl: error: no usable traces: {path}: {why}"), lines
        assert lines[1:] == [
            "hint: these files are not what `lingctl timer` writes; remove them or trace the job again"
        ]
        assert out == "" and not (tmp_path / "t").exists()


def test_a_fifo_named_like_a_meta_file_does_not_hang(capsys, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "rank-0.1.meta.json")  # nobody ever writes to it: an open that waited would never end
    code, _, err = cli(capsys, "timer", "export", str(tmp_path), "-o", str(tmp_path / "t"))
    assert code == 4 and f"{tmp_path / 'rank-0.1.meta.json'}: not a regular file" in err


def test_good_ranks_are_used_and_each_bad_file_is_one_warning(lingctl, tmp_path: Path) -> None:
    for rank in (0, 1):
        write_run(tmp_path, rank=rank, pid=900_000 + rank, world=2, records=steps(6, jitter_ms=rank))
    bad = [plant(tmp_path, content, n) for n, (_, content, _) in enumerate(BAD[:4])]
    reasons = [why for _, _, why in BAD[:4]]

    r = lingctl("timer", "diagnose", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [x["pid"] for x in d["ranks"]] == [900_000, 900_001]
    skipped = [n for n in d["notes"] if n.startswith("skipped ")]
    assert len(skipped) == len(bad)
    for path, why in zip(bad, reasons, strict=True):
        assert f"skipped {path}: {why}" in "\n".join(skipped)
    assert skipped_paths(r.stderr) == [str(p) for p in bad]

    r = lingctl("timer", "export", str(tmp_path), "-o", str(tmp_path / "t.json"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["events"] == 2 * 6 * 6
    assert skipped_paths(r.stderr) == [str(p) for p in bad]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr


def test_several_bad_files_and_no_good_one_name_the_first_and_warn_of_the_rest(capsys, tmp_path: Path) -> None:
    bad = [plant(tmp_path, content, n) for n, (_, content, _) in enumerate(BAD[:3])]
    code, _, err = cli(capsys, "timer", "diagnose", str(tmp_path))
    lines = err.splitlines()
    assert code == 4
    assert skipped_paths("\n".join(lines[:2])) == [str(p) for p in bad[1:]]
    assert lines[2].startswith(f"lingctl: error: no usable traces: {bad[0]}: ")
    assert lines[2].endswith("(and 2 more meta file(s) like it, above)")
