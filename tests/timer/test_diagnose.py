"""Hang and straggler diagnosis: the analysis on synthetic ranks (exact), then real traced gloo jobs."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
from typer.testing import CliRunner

from lingctl.commands.timer_render import render_diagnosis
from lingctl.timer.diagnose import analyse
from lingctl.timer.rank_data import GroupSeq, RankData
from lingctl.timer.ring import NO_GROUP, GroupState, Header, Kind, Op, Record
from tests.timer.test_attach import start

MS = 1_000_000
S = 1_000_000_000
NOW = 1_000 * S


def header(
    rank: int,
    world: int,
    *,
    step: int = 5,
    kind: Kind | int = 0,
    op: Op = Op.NONE,
    since_s: float = 0.0,
    groups: Sequence[GroupState] = (),
    heartbeat_age_s: float = 0.1,
) -> Header:
    return Header(
        pid=1000 + rank,
        create_time=0.0,
        rank=rank,
        world=world,
        local_rank=rank,
        capacity=1024,
        write_index=0,
        heartbeat_ns=NOW - int(heartbeat_age_s * S),
        mono_anchor_ns=0,
        wall_anchor_ns=0,
        step=step,
        step_start_ns=NOW - 2 * S,
        cur_kind=int(kind),
        cur_op=int(op),
        cur_group=0 if kind == Kind.COLLECTIVE else NO_GROUP,
        cur_seq=12 if kind == Kind.COLLECTIVE else 0,
        cur_since_ns=NOW - int(since_s * S),
        enabled=True,
        argv="train.py",
        groups=list(groups),
    )


def live_rank(
    rank: int,
    world: int,
    *,
    started: int,
    completed: int,
    in_flight: bool,
    waited_s: float = 0.0,
    kind: Kind | int = 0,
    since_s: float = 0.0,
    records: list[Record] | None = None,
    op: Op = Op.ALL_REDUCE,
) -> RankData:
    seq = GroupSeq(started, completed, in_flight, NOW - int(waited_s * S), int(op), world)
    state = GroupState(0, "0", world, int(op), in_flight, started, completed, seq.started_ns)
    h = header(
        rank,
        world,
        kind=kind,
        op=op if kind == Kind.COLLECTIVE else Op.NONE,
        since_s=since_s,
        groups=[state] if started >= 0 else [],
    )
    return RankData(
        rank=rank,
        pid=h.pid,
        world=world,
        records=records or [],
        group_names={0: "0"},
        groups={"0": seq} if started >= 0 else {},
        mono_anchor_ns=0,
        wall_anchor_ns=0,
        header=h,
    )


def test_hang_names_the_rank_that_never_arrived_and_where_it_is() -> None:
    ranks = [
        live_rank(r, 4, started=12, completed=11, in_flight=True, waited_s=30.0, kind=Kind.COLLECTIVE, since_s=30.0)
        for r in (0, 1, 3)
    ]
    ranks.append(live_rank(2, 4, started=11, completed=11, in_flight=False, kind=Kind.FORWARD, since_s=31.0))
    d = analyse(ranks, stacks=False, now_ns=NOW)
    assert d.verdict == "hang"
    (g,) = d.groups
    assert (g.group, g.seq, g.op) == ("0", 12, "all_reduce")
    assert g.waiting == {0: 30.0, 1: 30.0, 3: 30.0} and g.never_arrived == [2] and g.finished == []
    r2 = d.ranks[2]
    assert r2.where == "in forward for 31.0 s" and r2.step == 5 and r2.heartbeat_age_s == pytest.approx(0.1)
    assert d.ranks[0].where == "in all_reduce #12 of group 0 for 30.0 s"
    assert "waiting in all_reduce #12 of group 0" in d.summary and "rank 2 in forward" in d.summary
    text = render_diagnosis(d)
    assert text.startswith("verdict: hang") and "never arrived 2" in text
    assert json.loads(json.dumps(d.to_json()))["groups"][0]["never_arrived"] == [2]


def test_a_rank_that_never_reached_the_first_collective_never_arrived() -> None:
    ranks = [live_rank(r, 3, started=0, completed=-1, in_flight=True, waited_s=9.0) for r in (0, 2)]
    ranks.append(live_rank(1, 3, started=-1, completed=-1, in_flight=False, kind=Kind.DATA, since_s=9.5))
    d = analyse(ranks, stacks=False, now_ns=NOW)
    assert d.verdict == "hang" and d.groups[0].never_arrived == [1]
    assert d.ranks[1].where == "in data for 9.5 s"


def test_short_waits_are_not_a_hang() -> None:
    ranks = [
        live_rank(0, 2, started=4, completed=3, in_flight=True, waited_s=0.2),
        live_rank(1, 2, started=3, completed=3, in_flight=False),
    ]
    d = analyse(ranks, stacks=False, now_ns=NOW, hang_after_s=5.0)
    assert d.verdict == "ok" and d.groups[0].never_arrived == [1]
    assert analyse(ranks, stacks=False, now_ns=NOW, hang_after_s=0.1).verdict == "hang"


def test_everyone_inside_the_same_collective_blames_the_collective() -> None:
    ranks = [live_rank(r, 2, started=7, completed=6, in_flight=True, waited_s=60.0) for r in (0, 1)]
    d = analyse(ranks, stacks=False, now_ns=NOW)
    assert d.verdict == "hang" and d.groups[0].never_arrived == []
    assert "every member is inside it" in d.summary


def test_different_collectives_at_the_same_sequence_number_are_reported() -> None:
    ranks = [
        live_rank(0, 2, started=7, completed=6, in_flight=True, waited_s=60.0),
        live_rank(1, 2, started=7, completed=6, in_flight=True, waited_s=60.0, op=Op.BROADCAST),
    ]
    d = analyse(ranks, stacks=False, now_ns=NOW)
    assert d.verdict == "hang" and d.groups[0].mismatched_ops == {1: "broadcast"}
    assert "rank 1 broadcast" in d.summary


def steps(
    n: int,
    *,
    data_ms: float = 5,
    fwd_ms: float = 20,
    bwd_ms: float = 30,
    ar_ms: float = 4,
    late_ms: float = 0,
    slow_ar_ms: float = 0,
    jitter_ms: float = 0.0,
    offset_ns: int = 0,
) -> list[Record]:
    """``n`` synchronous steps on one rank. Every rank's all_reduce ``k`` ends at the same wall time; a rank with
    more data/compute (``late_ms``) starts it later and waits less. ``offset_ns`` shifts its monotonic clock."""
    out = []
    period = 100 * MS
    for k in range(n):
        t0 = k * period + offset_ns
        ar_end = t0 + int(80 * MS)
        ar_start = ar_end - int((ar_ms + 20 - late_ms + slow_ar_ms + (k % 3) * jitter_ms) * MS)
        fwd_start = t0 + int(data_ms * MS)
        out += [
            Record(Kind.DATA, 0, NO_GROUP, 0, t0, fwd_start, 0),
            Record(Kind.FORWARD, 0, NO_GROUP, 0, fwd_start, fwd_start + int(fwd_ms * MS), 0),
            Record(Kind.BACKWARD, 0, NO_GROUP, 0, fwd_start + int(fwd_ms * MS), ar_start, 0),
            Record(Kind.COLLECTIVE, Op.ALL_REDUCE, 0, k, ar_start, ar_end, 4096),
            Record(Kind.OPTIMIZER, 0, NO_GROUP, 0, ar_end, ar_end + 2 * MS, 0),
            Record(Kind.STEP, 0, NO_GROUP, k, t0, t0 + period, 0),
        ]
    return out


def finished_rank(rank: int, world: int, records: list[Record], *, offset_ns: int = 0) -> RankData:
    """A rank read from its log: clocks aligned through its anchors (monotonic ``offset_ns`` = wall 0)."""
    last = max(r.seq for r in records if r.kind == Kind.COLLECTIVE)
    return RankData(
        rank=rank,
        pid=None,
        world=world,
        records=records,
        group_names={0: "0"},
        groups={"0": GroupSeq(last, last, False, 0, int(Op.ALL_REDUCE))},
        mono_anchor_ns=offset_ns,
        wall_anchor_ns=0,
        source="log",
        alive=False,
    )


def test_slow_data_loading_makes_a_data_straggler() -> None:
    ranks = [
        finished_rank(0, 3, steps(12, jitter_ms=1)),
        finished_rank(2, 3, steps(12, jitter_ms=2)),
        finished_rank(1, 3, steps(12, data_ms=20, late_ms=15), offset_ns=10**12),
    ]
    ranks[2].records = steps(12, data_ms=20, late_ms=15, offset_ns=10**12)
    d = analyse(ranks, stacks=False)
    assert d.verdict == "straggler"
    s = d.straggler
    assert s is not None and (s.rank, s.category) == (1, "data") and s.last_arrival_share == 1.0
    assert d.collectives_compared == 12 and d.last_arrivals == {1: 12}
    assert s.evidence["data"] == {0: pytest.approx(0.005), 1: pytest.approx(0.020), 2: pytest.approx(0.005)}
    assert d.mean_lateness_s[1] > 0.01 > d.mean_lateness_s[0]
    assert "rank 1 is the straggler (data)" in d.summary


def test_slow_forward_makes_a_compute_straggler() -> None:
    ranks = [finished_rank(0, 2, steps(8)), finished_rank(1, 2, steps(8, fwd_ms=40, late_ms=20))]
    d = analyse(ranks, stacks=False)
    assert d.straggler is not None and (d.straggler.rank, d.straggler.category) == (1, "compute")


def test_even_arrivals_with_one_slow_link_is_communication() -> None:
    ranks = [
        finished_rank(0, 3, steps(8)),
        finished_rank(1, 3, steps(8)),
        finished_rank(2, 3, steps(8, ar_ms=4, slow_ar_ms=30, late_ms=30)),
    ]
    # rank 2 starts as early as its compute allows (late_ms cancels slow_ar_ms) but its collectives last longer
    ranks[2].records = steps(8, bwd_ms=0, slow_ar_ms=30)
    d = analyse(ranks, stacks=False)
    assert d.straggler is not None
    assert (d.straggler.rank, d.straggler.category) == (2, "communication")


def test_balanced_ranks_are_ok() -> None:
    ranks = [finished_rank(r, 3, steps(10, jitter_ms=0.5 * r)) for r in range(3)]
    d = analyse(ranks, stacks=False)
    assert d.verdict == "ok" and d.straggler is None and d.collectives_compared == 10


def test_a_job_that_ended_with_a_rank_behind_says_so() -> None:
    d = analyse([finished_rank(0, 2, steps(5)), finished_rank(1, 2, steps(4))], stacks=False)
    assert d.verdict != "hang" and d.groups[0].seq == 4 and d.groups[0].never_arrived == [1]
    assert any(n.startswith("rank(s) 1 stopped before all_reduce #4 of group 0") for n in d.notes)
    assert "group 0: all_reduce #4: waiting none, never arrived 1" in render_diagnosis(d)


def test_missing_ranks_are_noted() -> None:
    d = analyse([finished_rank(0, 4, steps(3)), finished_rank(1, 4, steps(3))], stacks=False)
    assert any("rank(s) 2, 3 of 4" in n for n in d.notes)


def test_a_finished_job_is_read_from_its_logs(tmp_path: Path) -> None:
    from lingctl.timer.diagnose import diagnose
    from tests.timer.test_export import write_run

    for rank, extra in ((0, {}), (1, {"data_ms": 20, "late_ms": 15}), (2, {})):
        write_run(tmp_path, rank=rank, pid=900_000 + rank, world=3, records=steps(10, jitter_ms=rank, **extra))
    # a launcher traced alongside the job: rank 0 of a world of 1, never in a process group
    write_run(tmp_path, rank=0, pid=899_999, world=1, groups={}, records=[])
    d = diagnose(tmp_path, stacks=False)
    assert [r.pid for r in d.ranks] == [900_000, 900_001, 900_002]
    assert any("ignored pid 899999 (also rank 0)" in n for n in d.notes)
    assert all(r.source == "log" and r.step == 10 for r in d.ranks)
    assert d.ranks[0].where == (
        "on elsewhere: read from its log, no live state; its last finished traced call was optimizer"
    )
    assert (
        d.verdict == "straggler"
        and d.straggler is not None
        and d.straggler.rank == 1
        and d.straggler.category == "data"
    )
    assert d.groups[0].seq == 9 and d.groups[0].waiting == {} and d.groups[0].never_arrived == []
    from lingctl.commands.timer import app

    r = CliRunner().invoke(app, ["diagnose", str(tmp_path)])
    assert r.exit_code == 0 and r.output.startswith("verdict: straggler: rank 1 is the straggler (data)")
    assert "straggler: rank 1 (data), last to arrive at 100% of 10 collectives" in r.output


def test_nothing_to_read_is_not_found(tmp_path: Path) -> None:
    from lingctl.commands.timer import app
    from lingctl.core.errors import NotFoundError, UsageError
    from lingctl.timer.diagnose import diagnose

    with pytest.raises(NotFoundError, match="no traces"):
        diagnose(tmp_path)
    with pytest.raises(NotFoundError, match="no such directory"):
        diagnose(tmp_path / "missing")
    with pytest.raises(NotFoundError, match="no process with pid"):
        diagnose(pids=[2**22 + 12345])
    with pytest.raises(NotFoundError, match=f"process {os.getpid()} is not traced"):
        diagnose(pids=[os.getpid()])
    r = CliRunner().invoke(app, ["diagnose", str(tmp_path)])
    assert isinstance(r.exception, NotFoundError) and r.exception.exit_code == 3
    for args in ([], [str(tmp_path), "--pids", "1"], ["--pids", "1,x"]):
        r = CliRunner().invoke(app, ["diagnose", *args])
        assert isinstance(r.exception, UsageError), args


# -- real traced gloo jobs -----------------------------------------------------------------------------------
def job_worker(out: str, mode: str, steps: int) -> None:
    """One rank of a small traced data-parallel job (rank and rendezvous from the environment).

    ``balanced``: every rank alike. ``hang``: after ``steps`` steps, rank 2 stalls inside its forward, so the
    others wait in all_reduce #``steps``. ``slow-data``: rank 1's data loading takes ~25 ms a batch, about twice
    its step's compute.
    """
    import datetime

    from lingctl.timer import install

    install(out)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])

    def stall() -> None:
        time.sleep(600)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
            self.stall_now = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.stall_now:
                stall()
            return self.body(x)

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if mode == "slow-data" and rank == 1:
                time.sleep(0.025 / 8)
            return torch.randn(64), torch.randn(1)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = iter(torch.utils.data.DataLoader(Batches(), batch_size=8))
    for step in range(steps + 1):
        x, y = next(loader)
        model.stall_now = mode == "hang" and rank == 2 and step == steps
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = torch.cat([cast(torch.Tensor, p.grad).flatten() for p in model.parameters()])
        dist.all_reduce(grads)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def start_job(procs: list, out: Path, world: int, mode: str, steps: int) -> list:
    from lingctl.core.net import free_port

    port = free_port()
    ranks = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
        }
        ranks.append(start(procs, "-m", "tests.timer.test_diagnose", str(out), mode, str(steps), env=env))
    return ranks


@pytest.mark.slow
def test_four_rank_hang_names_the_rank_that_never_arrived(procs, tmp_path, monkeypatch) -> None:
    from lingctl.commands.timer import app
    from lingctl.timer.diagnose import diagnose
    from lingctl.timer.ring import DIR_ENV

    # Rings of its own: the rings the job leaves when killed below must not be collected by other tracers.
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "rings"))
    steps_before = 3
    job = start_job(procs, tmp_path, 4, "hang", steps_before)
    deadline = time.monotonic() + 90
    d = None
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in job), "a rank exited early"
        if len(list(tmp_path.glob("rank-*.meta.json"))) == 4:
            d = diagnose(tmp_path, hang_after_s=1.0, stacks=False)
            # On a busy machine ranks can also wait over a second at the first collectives while the others
            # are still starting: the hang to wait for is the one at the stalled step.
            if d.verdict == "hang" and [g.seq for g in d.groups] == [steps_before]:
                break
        time.sleep(0.3)
    assert d is not None and d.verdict == "hang", d and render_diagnosis(d)

    t = time.monotonic()
    d = diagnose(tmp_path, hang_after_s=1.0)
    assert time.monotonic() - t < 5
    (g,) = d.groups
    assert (g.group, g.op, g.seq) == ("0", "all_reduce", steps_before)
    assert sorted(g.waiting) == [0, 1, 3] and g.never_arrived == [2]
    r2 = d.ranks[2]
    assert r2.source == "ring" and r2.step == steps_before and r2.where.startswith("in forward for ")
    assert r2.heartbeat_age_s is not None and r2.stacks is not None
    assert r2.heartbeat_age_s < 1 and "stall" in r2.stacks and "forward" in r2.stacks
    assert f"waiting in all_reduce #{steps_before} of group 0" in d.summary and "rank 2 in forward" in d.summary

    same = diagnose(pids=[p.pid for p in job], hang_after_s=1.0, stacks=False)
    assert same.verdict == "hang" and same.groups[0].never_arrived == [2]

    r = CliRunner().invoke(app, ["diagnose", str(tmp_path), "--json", "--hang-after", "1", "--no-stacks"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["verdict"] == "hang"

    # Killed as a hung job is (kill -9): the rings they leave still say where each rank was when it stopped.
    for p in job:  # all at once: a rank that saw a peer's socket close would end normally, removing its ring
        p.kill()
    for p in job:
        p.wait(timeout=30)
    d = diagnose(tmp_path, hang_after_s=1.0)
    assert d.verdict == "hang" and d.groups[0].never_arrived == [2] and sorted(d.groups[0].waiting) == [0, 1, 3]
    r2 = d.ranks[2]
    assert r2.source == "ring" and not r2.alive and r2.heartbeat_age_s is None and r2.stacks is None
    assert r2.where.startswith("exited; its ring shows it was in forward for ") and "optimizer" not in r2.where
    assert all(
        r.where.startswith(f"exited; its ring shows it was in all_reduce #{steps_before} of group 0")
        for r in d.ranks
        if r.rank != 2
    )


@pytest.mark.slow
def test_slow_data_loading_rank_is_the_straggler(procs, tmp_path) -> None:
    from lingctl.timer.diagnose import diagnose

    job = start_job(procs, tmp_path, 2, "slow-data", 20)
    for p in job:
        assert p.wait(timeout=90) == 0
    d = diagnose(tmp_path)
    assert d.verdict == "straggler", render_diagnosis(d)
    assert d.straggler is not None and (d.straggler.rank, d.straggler.category) == (1, "data")
    assert d.straggler.last_arrival_share >= 0.6 and d.collectives_compared == 21
    assert all(r.source == "log" and not r.alive and r.step == 21 for r in d.ranks)
    assert d.straggler.evidence["data"][1] > 0.015 > d.straggler.evidence["data"][0]


if __name__ == "__main__":
    job_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
