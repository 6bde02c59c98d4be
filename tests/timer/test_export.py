"""`timer export`: every rank's log on one Chrome-trace timeline (synthetic logs, then a real traced job)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import zstandard
from typer.testing import CliRunner

from lingctl.core.errors import NotFoundError
from lingctl.timer.ring import NO_GROUP, RECORD, Kind, Op, Record

MS = 1_000_000


def write_run(
    out: Path,
    *,
    rank: int,
    pid: int,
    records: list[Record],
    world: int = 2,
    mono_anchor_ns: int = 0,
    wall_anchor_ns: int = 0,
    groups: dict[str, int] | None = None,
    frames: int = 2,
) -> None:
    """A rank's files as the tracer writes them: raw records in several zstd frames, and the meta JSON."""
    log = f"rank-{rank}.{pid}.trace.zst"
    raw = [RECORD.pack(r.kind, r.op, r.group, r.seq, r.start_ns, r.end_ns, r.value) for r in records]
    cut = len(raw) // frames
    chunks = [raw[i * cut : (i + 1) * cut] if i < frames - 1 else raw[i * cut :] for i in range(frames)]
    (out / log).write_bytes(b"".join(zstandard.ZstdCompressor().compress(b"".join(c)) for c in chunks))
    meta = {
        "pid": pid,
        "rank": rank,
        "world": world,
        "local_rank": rank,
        "argv": "train.py",
        "hostname": "elsewhere",
        "ring": f"/nonexistent/{pid}.ring",
        "stacks": f"/nonexistent/{pid}.stacks",
        "log": log,
        "mono_anchor_ns": mono_anchor_ns,
        "wall_anchor_ns": wall_anchor_ns,
        "groups": groups if groups is not None else {"0": 0},
        "targets": ["collectives"],
        "capacity": 1024,
    }
    (out / f"rank-{rank}.{pid}.meta.json").write_text(json.dumps(meta))


def two_steps(shift_ns: int) -> list[Record]:
    """Two 10 ms steps; the all_reduce of step k ends at 10k + 9 ms (wall), so ranks line up after alignment."""
    out = []
    for k in range(2):
        t = k * 10 * MS + shift_ns
        out += [
            Record(Kind.FORWARD, 0, NO_GROUP, k, t, t + 4 * MS, 0),
            Record(Kind.COLLECTIVE, Op.ALL_REDUCE, 0, k, t + 5 * MS, t + 9 * MS, 4096),
            Record(Kind.STEP, 0, NO_GROUP, k, t, t + 10 * MS, 0),
        ]
    return out


def test_ranks_are_merged_on_the_wall_clock(tmp_path: Path) -> None:
    from lingctl.timer.export import export_chrome

    wall = 1_700_000_000 * 10**9
    # Rank 1's monotonic clock reads 5 s more than rank 0's at the same instant.
    write_run(tmp_path, rank=0, pid=11, records=two_steps(0), mono_anchor_ns=100 * MS, wall_anchor_ns=wall)
    write_run(tmp_path, rank=1, pid=22, records=two_steps(5000 * MS), mono_anchor_ns=5100 * MS, wall_anchor_ns=wall)
    dest = tmp_path / "out" / "trace.json"
    assert export_chrome(tmp_path, dest) == 12
    doc = json.loads(dest.read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0 (pid 11)"), (1, "rank 1 (pid 22)")}
    xs = [e for e in events if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0
    ar = {(e["pid"], e["name"]): e for e in xs if e["cat"] == "collective"}
    assert set(ar) == {(r, f"all_reduce #{k} (group 0)") for r in (0, 1) for k in (0, 1)}
    for k in (0, 1):
        a, b = ar[(0, f"all_reduce #{k} (group 0)")], ar[(1, f"all_reduce #{k} (group 0)")]
        assert a["ts"] == b["ts"] == 10_000 * k + 5_000 and a["dur"] == 4_000.0
        assert a["args"] == {"seq": k, "group": "0", "bytes": 4096, "step": k}
    step = next(e for e in xs if e["name"] == "step 1" and e["pid"] == 1)
    assert step["tid"] == 0 and step["dur"] == 10_000 and step["args"] == {"step": 1}
    fwd = next(e for e in xs if e["name"] == "forward" and e["pid"] == 0)
    assert fwd["tid"] == 1 and fwd["args"] == {"step": 0}


def test_cli_export_and_no_traces(tmp_path: Path) -> None:
    from lingctl.commands.timer import app

    write_run(tmp_path, rank=0, pid=11, records=two_steps(0), world=1)
    r = CliRunner().invoke(app, ["export", str(tmp_path), "-o", str(tmp_path / "t.json"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"path": str(tmp_path / "t.json"), "events": 6}
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(app, ["export", str(empty), "-o", str(tmp_path / "u.json")])
    assert isinstance(r.exception, NotFoundError) and "no traces" in r.exception.message
    assert not (tmp_path / "u.json").exists()


@pytest.mark.slow
def test_export_of_a_real_job(procs, tmp_path: Path) -> None:  # noqa: F811
    from lingctl.timer.export import export_chrome
    from tests.timer.test_diagnose import start_job

    for p in start_job(procs, tmp_path, 2, "balanced", 4):
        assert p.wait(timeout=90) == 0
    n = export_chrome(tmp_path, tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert n == len(xs) > 0 and min(e["ts"] for e in xs) == 0
    for rank in (0, 1):
        mine = {e["name"] for e in xs if e["pid"] == rank}
        assert {"forward", "backward", "optimizer", "data", "step 4"} <= mine
        assert {f"all_reduce #{k} (group 0)" for k in range(5)} <= mine
    ends: dict[str, list[float]] = {}
    for e in xs:
        if e["cat"] == "collective":
            ends.setdefault(e["name"], []).append(e["ts"] + e["dur"])
    for name, (a, b) in ends.items():  # an all_reduce ends on both ranks at about the same instant
        assert abs(a - b) < 50_000, name


def test_timer_run_passes_the_exit_code_and_traces_the_command(lingctl, tmp_path: Path) -> None:
    out = tmp_path / "trace"
    r = lingctl("timer", "run", "--out", str(out), "--", sys.executable, "-c", "import sys; sys.exit(7)")
    assert r.returncode == 7, r.stderr
    (meta,) = out.glob("rank-0.*.meta.json")
    assert json.loads(meta.read_text())["argv"].startswith("-c")
    r = lingctl("timer", "run", "--trace", "bogus", "--", "true")
    assert r.returncode == 2 and "unknown timer target 'bogus'" in r.stderr.splitlines()[0]
    r = lingctl("timer", "run")
    assert r.returncode == 2 and "no command to run" in r.stderr
