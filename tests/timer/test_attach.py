"""`timer attach`: snapshots of synthetic rings, of real traced processes (a training loop, a process stuck in C
holding the GIL), of untraced ones, and the errors for missing pids and other users' processes.

Run as ``python -m tests.timer.test_attach loop|gil`` this file is also the traced process the tests attach to.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.timer.ring import Kind, Op, RingReader, RingWriter, ring_path

REPO = Path(__file__).resolve().parents[2]
MS = 1_000_000


# -- the traced processes ------------------------------------------------------------------------------------
def training_loop() -> None:
    """A small traced training loop that runs until killed."""
    from lingctl.timer import install

    install()
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1)), batch_size=8
    )
    while True:
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.005)


def catastrophic_backtracking() -> None:
    """Exponential regex matching: minutes inside one C call that never releases the GIL."""
    re.match(r"(a+)+$", "a" * 40 + "b")


def stuck_in_c() -> None:
    from lingctl.timer import install

    install()
    print("ready", flush=True)
    catastrophic_backtracking()


# -- helpers -----------------------------------------------------------------------------------------------
def start(procs: list[subprocess.Popen], *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    procs.append(p)
    return p


def wait_for_ring(pid: int, *, steps: int = 0, timeout: float = 60.0) -> None:
    """Until ``pid`` is traced and has finished ``steps`` steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reader = RingReader(ring_path(pid))
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        try:
            if reader.header().step >= steps:
                return
        finally:
            reader.close()
        time.sleep(0.05)
    raise TimeoutError(f"pid {pid}: no ring with {steps} finished steps after {timeout:.0f} s")


def heartbeat_age_s(pid: int) -> float:
    reader = RingReader(ring_path(pid))
    try:
        return (time.monotonic_ns() - reader.header().heartbeat_ns) / 1e9
    finally:
        reader.close()


def attach_cli(*args: str):
    from lingctl.commands.timer import app

    return CliRunner().invoke(app, ["attach", *args])


# -- synthetic ring ----------------------------------------------------------------------------------------
@pytest.fixture
def own_ring() -> Iterator[RingWriter]:
    """A ring for this very process, as the tracer would write it (removed afterwards)."""
    w = RingWriter(ring_path(os.getpid()), capacity=256, rank=3, world=8, local_rank=1, argv="train.py --lr 1")
    yield w
    w.close()


def test_snapshot_of_a_traced_process(own_ring: RingWriter) -> None:
    from lingctl.commands.timer_render import render, status_line
    from lingctl.timer.attach import Attacher, snapshot

    w = own_ring
    g = w.group_index("0", 8)
    now = time.monotonic_ns()
    t0 = now - 10_000 * MS
    for step in range(3):  # 100 ms steps: 30 data, 40 forward, 30 all_reduce
        s = t0 + step * 100 * MS
        w.append(Kind.DATA, 0, 0xFFFF, step, s, s + 30 * MS)
        w.append(Kind.FORWARD, 0, 0xFFFF, step, s + 30 * MS, s + 70 * MS)
        w.append(Kind.COLLECTIVE, Op.ALL_REDUCE, g, step, s + 70 * MS, s + 100 * MS, 1024)
        w.append(Kind.STEP, 0, 0xFFFF, step, s, s + 100 * MS)
    w.set_step(3, t0 + 300 * MS)
    w.group_started(g, Op.ALL_REDUCE, 3, now - 2_000 * MS)
    w.enter(Kind.COLLECTIVE, Op.ALL_REDUCE, g, 3)
    w.heartbeat()

    snap = snapshot(os.getpid(), window_steps=2)
    assert snap["traced"] and snap["note"] is None and snap["process"]["rss_bytes"] > 0
    t = snap["trace"]
    assert (t["rank"], t["world"], t["local_rank"], t["step"], t["enabled"]) == (3, 8, 1, 3, True)
    assert t["inside"]["kind"] == "collective" and t["inside"]["op"] == "all_reduce"
    assert t["inside"]["group"] == "0" and t["inside"]["seq"] == 3 and t["inside"]["for_s"] < 1
    assert t["groups"] == [
        {"name": "0", "size": 8, "started_seq": 3, "completed_seq": -1, "in_flight": True, "last_op": "all_reduce"}
    ]
    assert t["heartbeat_age_s"] < 1
    b = t["breakdown"]
    assert b["steps"] == 2 and b["last_step"] == 2
    assert b["step_time_s"]["mean"] == pytest.approx(0.1)
    assert b["parts_s"]["data"]["mean"] == pytest.approx(0.03)
    assert b["parts_s"]["all_reduce"]["last"] == pytest.approx(0.03)
    assert b["collective_seq"] == {"0": 2}
    json.dumps(snap)
    assert "rank 3 of 8" in render(snap) and "all_reduce #3 of group 0" in status_line(snap)

    a = Attacher(os.getpid(), window_steps=5)  # live refresh: new records only are read
    try:
        assert a.snapshot()["trace"]["breakdown"]["steps"] == 3
        s = t0 + 300 * MS
        w.append(Kind.STEP, 0, 0xFFFF, 3, s, s + 200 * MS)
        assert a.snapshot()["trace"]["breakdown"]["step_time_s"]["last"] == pytest.approx(0.2)
    finally:
        a.close()


def test_a_ring_left_by_an_earlier_process_with_the_same_pid_is_ignored(own_ring: RingWriter) -> None:
    import struct

    from lingctl.timer.attach import snapshot

    struct.pack_into("<d", own_ring.mm, 24, 12345.0)  # another start time
    assert snapshot(os.getpid())["traced"] is False


def test_missing_pid_is_not_found() -> None:
    from lingctl.timer.attach import snapshot

    pid = 2**22 + 12345  # above the kernel's pid_max default
    with pytest.raises(NotFoundError, match=f"^no process with pid {pid}$"):
        snapshot(pid)
    r = attach_cli("--pid", str(pid), "--once")
    assert isinstance(r.exception, NotFoundError) and r.exception.exit_code == 3


def test_missing_pid_cli_exits_3_with_one_line(lingctl) -> None:
    r = lingctl("timer", "attach", "--pid", str(2**22 + 12345), "--once")
    assert r.returncode == 3
    assert r.stderr.strip().splitlines() == [f"lingctl: error: no process with pid {2**22 + 12345}"]
    assert r.stdout == ""


def test_a_pid_that_is_not_a_process_id_is_a_usage_error(lingctl) -> None:
    from lingctl.core.errors import UsageError

    r = lingctl("timer", "attach", "--pid", "-5")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "lingctl: error: pid -5 is not a process id (process ids are positive numbers)"
    ]
    for pid in ("0", "-1"):  # kill() would take these for process groups
        r = attach_cli("--pid", pid, "--once")
        assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, pid
    from lingctl.commands.timer import app

    r = CliRunner().invoke(app, ["diagnose", "--pids", "0"])
    assert isinstance(r.exception, UsageError)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to another user")
def test_another_users_process_is_one_line_error(procs) -> None:
    """A real attach from user ``nobody`` (a forked child that drops root) to a process root owns."""
    import pwd

    from lingctl.timer.attach import snapshot

    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody")
    target = start(procs, "-c", "import time; time.sleep(60)")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(read)
        try:
            os.setuid(nobody)
            snapshot(target.pid)
            message = "no error"
        except LingctlError as err:
            message = f"{type(err).__name__} {err.exit_code} {err.message}"
        except BaseException as err:
            message = f"unexpected {err!r}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(child, 0)
    assert message == (f"LingctlError 1 process {target.pid} belongs to user root; attach as that user (or root)")


def test_access_denied_is_one_line() -> None:
    import psutil

    from lingctl.timer import attach

    err = attach.access_denied(4321)
    assert isinstance(err, LingctlError) and err.exit_code == 1 and "\n" not in err.message
    assert issubclass(psutil.AccessDenied, psutil.Error)


def test_untraced_process_says_what_it_cannot_see(procs) -> None:
    from lingctl.timer.attach import py_spy, snapshot

    p = start(procs, "-c", "import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()")
    time.sleep(0.3)
    t = time.monotonic()
    snap = snapshot(p.pid, stacks=True)
    assert snap["traced"] is False and snap["trace"] is None
    assert snap["note"].startswith("not traced: no step times; start it under `lingctl timer run`")
    assert snap["process"]["threads"] >= 1
    if py_spy() is not None:
        assert snap["stacks_source"] == "py-spy" and "waiting_here" in snap["stacks"]
    else:
        assert snap["stacks"] is None and "py-spy" in snap["stacks_note"]
    assert p.poll() is None, "an untraced process must never be signalled"
    assert time.monotonic() - t < 10
    r = attach_cli("--pid", str(p.pid), "--once")
    assert r.exit_code == 0 and "not traced" in r.output


def test_import_is_cheap() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); import lingctl.commands.timer, lingctl.timer.attach, "
        "lingctl.timer.diagnose; print('torch' in sys.modules, time.perf_counter() - t)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    loaded, seconds = r.stdout.split()
    assert loaded == "False" and float(seconds) < 1.0


# -- real traced processes ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_attach_once_json_on_a_live_training_loop(procs) -> None:
    p = start(procs, "-m", "tests.timer.test_attach", "loop")
    wait_for_ring(p.pid, steps=5)
    r = attach_cli("--pid", str(p.pid), "--once", "--json", "--steps", "4")
    assert r.exit_code == 0, r.output
    snap = json.loads(r.output)
    assert snap["traced"] and snap["trace"]["step"] >= 5 and snap["process"]["cpu_percent"] >= 0
    b = snap["trace"]["breakdown"]
    assert b["steps"] == 4 and b["step_time_s"]["mean"] > 0 and b["throughput_steps_per_s"] > 0
    assert {"data", "forward", "backward", "optimizer", "other"} <= set(b["parts_s"])
    assert b["parts_s"]["forward"]["mean"] > 0 and b["parts_s"]["other"]["mean"] >= 0.004  # the sleep


@pytest.mark.slow
def test_attach_streams_json_lines_until_interrupted(procs) -> None:
    p = start(procs, "-m", "tests.timer.test_attach", "loop")
    wait_for_ring(p.pid, steps=2)
    # Ctrl-C's default action for the viewer, whatever this test run inherited: a test suite started in the
    # background by a shell ignores SIGINT, its children inherit that, and Python then installs no handler.
    argv = [sys.executable, "-m", "lingctl", "timer", "attach", "--pid", str(p.pid), "--json", "--interval", "0.2"]
    restore = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    viewer = subprocess.Popen(
        [sys.executable, "-c", restore, *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(viewer)
    assert viewer.stdout is not None
    lines = [json.loads(viewer.stdout.readline()) for _ in range(3)]
    viewer.send_signal(signal.SIGINT)
    # Keep reading while it stops: a viewer blocked on a full pipe could not finish its last write, and on a
    # busy machine its exit can take a while; the deadline is generous, the condition is its exit.
    viewer.communicate(timeout=60)
    assert viewer.returncode in (0, 130)
    steps = [line["trace"]["step"] for line in lines]
    assert steps == sorted(steps) and steps[-1] > steps[0]


@pytest.mark.slow
def test_stacks_of_a_process_stuck_in_c_holding_the_gil(procs) -> None:
    from lingctl.timer.attach import snapshot

    p = start(procs, "-m", "tests.timer.test_attach", "gil")
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    wait_for_ring(p.pid)
    deadline = time.monotonic() + 60  # until it is inside re.match: the tracer's heartbeat thread cannot run
    while heartbeat_age_s(p.pid) < 0.7:
        assert time.monotonic() < deadline, "the heartbeat never went stale"
        time.sleep(0.05)
    t = time.monotonic()
    snap = snapshot(p.pid, stacks=True)
    assert time.monotonic() - t < 3
    assert snap["stacks_source"] == "faulthandler"
    assert "catastrophic_backtracking" in snap["stacks"] and "stuck_in_c" in snap["stacks"]
    assert snap["trace"]["heartbeat_age_s"] > 0.5
    r = attach_cli("--pid", str(p.pid), "--once", "--stacks")
    assert r.exit_code == 0 and "catastrophic_backtracking" in r.output and "heartbeat is stale" in r.output


if __name__ == "__main__":
    {"loop": training_loop, "gil": stuck_in_c}[sys.argv[1]]()
