"""The tracer in real processes: a small training loop traced end to end, stale rings, stacks of a process
stuck in C, self-disabling on internal errors, and ``run_traced`` across a process tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lingctl.core.net import free_port
from lingctl.timer.launch import INJECT_DIR, run_traced, traced_env
from lingctl.timer.logs import find_runs, read_log
from lingctl.timer.ring import Kind, Op, RingReader, collect_stale, ring_path
from lingctl.timer.tracer import DEFAULT_TARGETS, collect_stale_files, log_path, parse_targets, read_stacks, stacks_path

TRAIN = """
import json, os, sys, time
from pathlib import Path
from lingctl.timer import install

tracer = install(sys.argv[1])
import torch
import torch.distributed as dist
from lingctl.core.net import free_port
from lingctl.timer.ring import Kind, Op

torch.manual_seed(0)
torch.set_num_threads(1)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(80, 8), torch.randn(80, 1))
for x, y in torch.utils.data.DataLoader(data, batch_size=4):  # 20 steps
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    dist.all_reduce(loss.detach())
    opt.step()

Path(sys.argv[2]).write_text(json.dumps({"pid": os.getpid()}))
deadline = time.monotonic() + 60
while not Path(sys.argv[3]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)

# Measured after the test read the ring: these calls add ~30000 records (and collectives on group 0).
def best_us(fn, *args, n=5000):
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best

def fake_all_reduce(tensor, op=None, group=None, async_op=False):
    pass

def noop():
    pass

t = torch.ones(1)
coll = best_us(tracer._comm(fake_all_reduce, Kind.COLLECTIVE, Op.ALL_REDUCE, "tensor"), t) - best_us(fake_all_reduce, t)
timed = best_us(tracer._timed(noop, int(Kind.DATA))) - best_us(noop)
print(f"overhead per call: collective wrapper {coll:.2f} us, plain timing wrapper {timed:.2f} us", flush=True)
dist.destroy_process_group()
"""

TWO_RANKS = """
import sys
from lingctl.timer import install

out, port, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
install(out)  # no RANK in the environment: files start as rank 0 and are renamed once the rank is known
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
for i in range(5):
    dist.all_reduce(torch.ones(3))
dist.broadcast(torch.zeros(2), src=0)
dist.barrier()
dist.destroy_process_group()
"""

IDLE = """
import sys
from lingctl.timer import install
install({out!r})
print("ready", flush=True)
sys.stdin.read()  # until the test closes stdin
"""

STUCK = """
import re
from lingctl.timer import install
install()

def stuck_in_regex():
    print("ready", flush=True)
    re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking: in C, holding the GIL, for ages

stuck_in_regex()
"""

BROKEN = """
import os, sys
from lingctl.timer import install
from lingctl.timer.ring import RingReader, ring_path

tracer = install()
import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def step():
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

for _ in range(3):
    step()
if sys.argv[1] == "append":
    def boom(*args, **kwargs):
        raise RuntimeError("injected")
    tracer.writer.append = boom
else:
    tracer.writer.mm.close()
for _ in range(3):
    step()
if sys.argv[1] == "append":
    print("enabled", RingReader(ring_path(os.getpid())).header().enabled)
print("done", tracer.active)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts; any still running at the end are killed."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    collect_stale_files()


def start(procs: list[subprocess.Popen], script: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    return proc


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_training_loop_is_traced_and_logged(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    out, ready, go = tmp_path / "out", tmp_path / "ready.json", tmp_path / "go"
    proc = start(procs, write(tmp_path, "train.py", TRAIN), str(out), str(ready), str(go))
    wait_for(lambda: ready.exists() or proc.poll() is not None, 90, "training script did not get ready")
    assert proc.poll() is None, proc.communicate()[1]
    pid = json.loads(ready.read_text())["pid"]

    reader = RingReader(ring_path(pid))
    try:
        h = reader.header()
        records, end = reader.records()
        time.sleep(0.35)
        assert reader.header().heartbeat_ns > h.heartbeat_ns
    finally:
        reader.close()
    assert h.pid == pid and h.step == 20 and h.enabled and h.rank == 0 and h.world == 1
    assert [g.name for g in h.groups] == ["0"] and h.groups[0].completed_seq == 19
    assert not h.groups[0].in_flight and h.cur_kind == 0
    by_kind: dict[int, list] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    for kind in (Kind.STEP, Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER, Kind.DATA, Kind.COLLECTIVE):
        assert by_kind.get(kind), f"no {kind.name} record"
        assert all(r.duration_ns > 0 for r in by_kind[kind]), kind.name
    assert [r.seq for r in by_kind[Kind.STEP]] == list(range(20))
    assert len(by_kind[Kind.FORWARD]) == 20  # outermost module calls only (the Sequential, not its layers)
    assert len(by_kind[Kind.BACKWARD]) == 20 and len(by_kind[Kind.OPTIMIZER]) == 20
    collectives = by_kind[Kind.COLLECTIVE]
    assert [r.seq for r in collectives] == list(range(20)) and {r.group for r in collectives} == {0}
    assert all(r.value == 4 for r in collectives)  # one float32 loss
    steps = by_kind[Kind.STEP]
    assert all(a.end_ns == b.start_ns for a, b in zip(steps, steps[1:]))  # steps tile the timeline

    go.touch()
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    print(stdout.strip())
    assert not ring_path(pid).exists() and not stacks_path(pid).exists()
    runs = find_runs(out)
    assert [(m["pid"], m["rank"], m["groups"]) for m in runs] == [(pid, 0, {"0": 0})]
    logged = read_log(log_path(out, 0, pid))
    assert runs[0]["log_path"] == str(log_path(out, 0, pid).resolve())
    assert logged[:end] == records  # everything in the ring when it was read, in order, then what came later
    assert len(logged) > end


def test_ranks_learned_from_init_process_group_and_collectives_line_up(
    tmp_path: Path, procs: list[subprocess.Popen]
) -> None:
    script, out, port = write(tmp_path, "ranks.py", TWO_RANKS), tmp_path / "out", str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for rank in (0, 1):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out), port, str(rank)], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    for proc in procs:
        assert proc.stderr is not None
        assert proc.wait(timeout=90) == 0, proc.stderr.read()
    runs = find_runs(out)
    assert [(m["rank"], m["world"], m["rank_source"]) for m in runs] == [(0, 2, "dist"), (1, 2, "dist")]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        name for m in runs for name in (Path(m["meta_path"]).name, Path(m["log_path"]).name)
    )
    ops = []
    for m in runs:
        records = [r for r in read_log(Path(m["log_path"])) if r.kind == Kind.COLLECTIVE]
        ops.append([(r.group, r.seq, r.op, r.value) for r in records])
    assert ops[0] == ops[1]
    assert ops[0] == [(0, i, Op.ALL_REDUCE, 12) for i in range(5)] + [(0, 5, Op.BROADCAST, 8), (0, 6, Op.BARRIER, 0)]


def test_sigkill_leaves_a_ring_that_collection_removes(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    idle = write(tmp_path, "idle.py", IDLE.format(out=None))
    victim, survivor = start(procs, idle), start(procs, idle)
    for proc in (victim, survivor):
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    victim.kill()
    victim.wait()
    assert ring_path(victim.pid).exists() and stacks_path(victim.pid).exists()
    assert ring_path(victim.pid) in collect_stale()
    assert not ring_path(victim.pid).exists() and ring_path(survivor.pid).exists()
    collect_stale_files()
    assert not stacks_path(victim.pid).exists() and stacks_path(survivor.pid).exists()
    assert survivor.stdin is not None
    survivor.stdin.close()  # a normal exit removes its own files
    assert survivor.wait(timeout=10) == 0
    assert not ring_path(survivor.pid).exists() and not stacks_path(survivor.pid).exists()


def test_stacks_of_a_process_stuck_in_c_holding_the_gil(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    proc = start(procs, write(tmp_path, "stuck.py", STUCK))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    text = read_stacks(proc.pid)
    assert "in stuck_in_regex" in text and "stuck.py" in text, text
    assert proc.poll() is None


@pytest.mark.parametrize("how", ["append", "mmap"])
def test_internal_error_disables_tracing_with_one_warning(
    tmp_path: Path, procs: list[subprocess.Popen], how: str
) -> None:
    proc = start(procs, write(tmp_path, "broken.py", BROKEN), how)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stdout.splitlines()[-1] == "done False"
    if how == "append":
        assert "enabled False" in stdout
    assert stderr.count("tracing disabled after an internal error") == 1, stderr
    assert stderr.count("lingctl timer") == 1, stderr
    assert not ring_path(proc.pid).exists()


def test_run_traced_traces_the_whole_process_tree(tmp_path: Path) -> None:
    child = write(tmp_path, "child.py", "import time; time.sleep(0.1)\n")
    pids = tmp_path / "pids.txt"
    parent = write(
        tmp_path,
        "parent.py",
        f"""
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, {str(child)!r}])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        sys.exit(child.wait())
        """,
    )
    out = tmp_path / "out" / "nested"  # created by run_traced
    assert run_traced([sys.executable, str(parent)], out=out, targets="collectives,-p2p") == 0
    assert sorted(m["pid"] for m in find_runs(out)) == sorted(map(int, pids.read_text().split()))
    runs = find_runs(out)
    assert all(m["rank"] == 0 and m["rank_source"] == "default" for m in runs)
    assert all(not Path(m["ring"]).exists() for m in runs)  # both exited normally


def test_run_traced_forwards_sigterm_and_reports_the_signal(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    runner = write(
        tmp_path,
        "runner.py",
        f"""
        import sys
        from pathlib import Path
        from lingctl.timer.launch import run_traced
        cmd = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(60)"]
        sys.exit(run_traced(cmd, out=Path({str(tmp_path / "out")!r}), targets=None))
        """,
    )
    proc = start(procs, runner)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "sleeping"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM


def test_inject_chains_to_the_next_sitecustomize_and_survives_errors(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('next sitecustomize ran')\n")
    env = traced_env(tmp_path / "out", "bogus")
    env["PYTHONPATH"] += os.pathsep + str(other)
    code = "from lingctl.timer.tracer import current; print('traced', current() is not None)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["next sitecustomize ran", "traced False"]
    assert "is not traced" in result.stderr and "bogus" in result.stderr
    env = traced_env(tmp_path / "out", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "traced True" and str(INJECT_DIR) in env["PYTHONPATH"]


def test_parse_targets() -> None:
    assert parse_targets(None) == parse_targets("default") == parse_targets("all") == set(DEFAULT_TARGETS)
    assert parse_targets("") == set(DEFAULT_TARGETS)
    assert parse_targets("collectives, p2p") == {"collectives", "p2p"}
    assert parse_targets("-copy,-forward") == set(DEFAULT_TARGETS) - {"copy", "forward"}
    assert parse_targets("default,-data") == set(DEFAULT_TARGETS) - {"data"}
    assert parse_targets("data,-data") == set()
    with pytest.raises(ValueError, match="'colectives'.*collectives, p2p"):
        parse_targets("colectives")


def test_run_traced_names_a_missing_command(tmp_path) -> None:
    from lingctl.core.errors import NotFoundError
    from lingctl.timer.launch import run_traced

    with pytest.raises(NotFoundError, match="command not found: /nonexistent-command"):
        run_traced(["/nonexistent-command"], out=tmp_path / "t", targets=None)
