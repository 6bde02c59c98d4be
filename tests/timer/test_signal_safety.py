"""Drills for the stacks signal: lingctl signals only a traced process of the ring directory's owner.

Rings and meta files are data their owner wrote, and a ring's header names a pid and that process's start time
(which anyone can read from ``/proc``). Root's ``timer diagnose`` or ``attach --stacks`` would then send SIGUSR2,
whose default action ends a process, to whatever pid another user names. These tests plant such rings the way
that user would (files owned by another uid, naming a process of root's and its true start time) and check that
the named process lives on and the report says why its stacks were not asked for; and that a process which does
hold its stacks file open and catch the signal, but runs as another uid than the ring directory's owner, is not
signalled either, while the same process under the owner's uid is.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lingctl.timer.attach import ask_for_stacks, request_stacks
from lingctl.timer.ring import DIR_ENV, Op, RingReader, RingWriter, user_ring_dir

S = 1_000_000_000
PLANTED = b"what the planted stacks file holds\n"
DEAD_PID = 2**22 + 777  # above any pid_max Linux allows: no process has it
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="only root can give files to another uid")
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")

# A process that behaves as a traced one towards the signal: it holds the stacks file open (the descriptor in
# argv[1]) and, with argv[2] == "catch", has faulthandler dump into it on SIGUSR2, as the tracer does. It needs only
# the standard library, so it runs under any uid.
HOLDER = """
import faulthandler, os, signal, sys, time
f = os.fdopen(int(sys.argv[1]), "w")
if sys.argv[2] == "catch":
    faulthandler.register(signal.SIGUSR2, file=f, all_threads=True, chain=False)
def holding_the_stacks_file():
    print("ready", flush=True)
    time.sleep(600)
holding_the_stacks_file()
"""


def other_uid() -> int:
    """A uid nobody on this machine uses, whose default ring directory does not exist yet."""
    for uid in range(61000 + os.getpid() % 1000, 65000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if not os.path.lexists(user_ring_dir(uid)):
                return uid
    raise RuntimeError("no free uid")


def plant_ring(
    directory: Path,
    *,
    pid: int,
    create_time: float,
    rank: int,
    world: int,
    started: int,
    completed: int,
    waited_s: float = 0.0,
) -> tuple[int, int]:
    """A ring in ``directory`` whose header claims process ``pid`` (started at ``create_time``) as ``rank``, in
    group 0 at all_reduce ``started`` (``completed`` done); returns its clock anchors for the meta file."""
    w = RingWriter(directory / f"{pid}.ring", capacity=16, rank=rank, world=world, local_rank=rank)
    try:
        struct.pack_into("<qd", w.mm, 16, pid, create_time)
        g = w.group_index("0", world)
        base = 10 * S
        w.group_started(g, Op.ALL_REDUCE, started, base)
        w.group_completed(g, completed)
        struct.pack_into("<q", w.mm, 64, base + int(waited_s * S))  # the last heartbeat
    finally:
        w.close(remove=False)
    reader = RingReader(directory / f"{pid}.ring")
    try:
        h = reader.header()
    finally:
        reader.close()
    return h.mono_anchor_ns, h.wall_anchor_ns


def write_meta(out: Path, *, pid: int, rank: int, world: int, anchors: tuple[int, int], ring: Path) -> Path:
    path = out / f"rank-{rank}.{pid}.meta.json"
    meta = {
        "pid": pid,
        "rank": rank,
        "world": world,
        "local_rank": rank,
        "argv": "train.py",
        "hostname": socket.gethostname(),
        "ring": str(ring),
        "stacks": str(ring.with_suffix(".stacks")),
        "log": f"rank-{rank}.{pid}.trace.zst",
        "mono_anchor_ns": anchors[0],
        "wall_anchor_ns": anchors[1],
        "groups": {"0": 0},
        "targets": ["collectives"],
        "capacity": 16,
    }
    path.write_text(json.dumps(meta))
    return path


def plant_hung_job(out: Path, rings: Path, victim: int) -> list[Path]:
    """Two ranks as a hung job would leave them: rank 0 (gone) waited 100 s in all_reduce #5; rank 1, the
    ``victim`` with its true start time, never arrived, so diagnose asks rank 1 for its stacks. Every file the
    user could plant: the rings, an empty stacks file under the victim's pid, the meta files."""
    rings.mkdir(mode=0o700)
    planted = [rings]
    ct = psutil.Process(victim).create_time()
    for rank, pid, create_time, started, completed in ((0, DEAD_PID, 1.0, 5, 4), (1, victim, ct, 4, 4)):
        anchors = plant_ring(
            rings,
            pid=pid,
            create_time=create_time,
            rank=rank,
            world=2,
            started=started,
            completed=completed,
            waited_s=100.0,
        )
        ring = rings / f"{pid}.ring"
        planted += [ring, write_meta(out, pid=pid, rank=rank, world=2, anchors=anchors, ring=ring)]
    stacks = rings / f"{victim}.stacks"
    stacks.write_bytes(PLANTED)
    stacks.chmod(0o600)
    return [*planted, stacks]


def start_sleeper(procs: list[subprocess.Popen]) -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "600"])
    procs.append(p)
    return p


@pytest.fixture
def attacker() -> Iterator[int]:
    """Another user's uid; their default ring directory is removed at the end."""
    uid = other_uid()
    yield uid
    shutil.rmtree(user_ring_dir(uid), ignore_errors=True)


def diagnose_cli(lingctl, out: Path, rings_env: Path) -> subprocess.CompletedProcess[str]:
    # The caller's own ring directory points at an empty place: only the planted rings can be found.
    return lingctl("timer", "diagnose", str(out), env={**os.environ, DIR_ENV: str(rings_env)}, timeout=60)


@needs_root
def test_root_diagnose_never_signals_a_process_another_user_names(lingctl, procs, tmp_path, attacker) -> None:
    victim = start_sleeper(procs)  # root's
    out = tmp_path / "job"
    out.mkdir()
    for path in plant_hung_job(out, user_ring_dir(attacker), victim.pid):
        os.chown(path, attacker, attacker)  # as if that user had written them
    os.chown(out, attacker, attacker)

    r = diagnose_cli(lingctl, out, tmp_path / "own-rings")
    assert r.returncode == 0, r.stderr
    assert victim.poll() is None, f"the victim was killed (status {victim.returncode})"
    assert psutil.Process(victim.pid).status() != psutil.STATUS_ZOMBIE
    assert r.stdout.startswith("verdict: hang: rank(s) 0 waiting in all_reduce #5 of group 0"), r.stdout
    expected = (
        f"stacks of rank 1 (pid {victim.pid}): not requested: process {victim.pid} could not be shown to be a "
        f"traced process of the ring's owner (uid {attacker}): it runs as uid 0"
    )
    assert expected in r.stdout, r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    assert (user_ring_dir(attacker) / f"{victim.pid}.stacks").read_bytes() == PLANTED  # refused before touching it


def test_diagnose_never_signals_a_process_that_is_not_traced(lingctl, procs, tmp_path) -> None:
    victim = start_sleeper(procs)  # ours, so only the proof of tracing stands between it and the signal
    out, rings = tmp_path / "job", tmp_path / "rings"
    out.mkdir()
    plant_hung_job(out, rings, victim.pid)
    r = diagnose_cli(lingctl, out, rings)
    assert r.returncode == 0, r.stderr
    assert victim.poll() is None, f"the victim was killed (status {victim.returncode})"
    assert f"stacks of rank 1 (pid {victim.pid}): not requested: process {victim.pid} could not be shown" in r.stdout
    assert "it does not catch SIGUSR2 (the signal would end it)" in r.stdout, r.stdout
    assert (rings / f"{victim.pid}.stacks").read_bytes() == PLANTED

    r = lingctl("timer", "diagnose", str(out), "--json", env={**os.environ, DIR_ENV: str(rings)}, timeout=60)
    ranks = json.loads(r.stdout)["ranks"]
    assert ranks[1]["stacks"] is None and "could not be shown" in ranks[1]["stacks_note"]
    assert victim.poll() is None


def start_holder(
    procs: list[subprocess.Popen],
    rings: Path,
    *,
    owner: int | None = None,
    run_as: tuple[str, ...] = (),
    catch: bool = True,
    ring_start_offset_s: float = 0.0,
) -> tuple[subprocess.Popen, Path, Path]:
    """A holder process (started through ``run_as``) of the stacks file in ``rings``, with a ring naming its pid
    and its start time (moved by ``ring_start_offset_s``); the directory and files are given to ``owner``."""
    rings.mkdir(mode=0o700)
    fd = os.open(rings / "new.stacks", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        p = subprocess.Popen(
            [*run_as, sys.executable, "-c", HOLDER, str(fd), "catch" if catch else "hold"],
            pass_fds=(fd,),
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
    finally:
        os.close(fd)
    procs.append(p)
    assert p.stdout is not None
    ready = p.stdout.readline().strip() == "ready"
    if not ready and run_as and p.wait(timeout=30) != 0:
        pytest.skip(f"{sys.executable} cannot be run by another uid here")
    assert ready
    stacks = rings / f"{p.pid}.stacks"
    os.rename(rings / "new.stacks", stacks)
    started = psutil.Process(p.pid).create_time() + ring_start_offset_s
    plant_ring(rings, pid=p.pid, create_time=started, rank=0, world=1, started=-1, completed=-1)
    ring = rings / f"{p.pid}.ring"
    if owner is not None:
        for path in (rings, ring, stacks):
            os.chown(path, owner, owner)
    return p, ring, stacks


@needs_root
@needs_setpriv
@pytest.mark.parametrize(
    "run_as, why",
    [
        ((), "it runs as uid 0"),
        (("setpriv", "--ruid={uid}", "--"), "it runs as uid {uid} (effective 0, saved 0)"),
    ],
    ids=["root", "real-uid-only"],
)
def test_a_holder_of_the_stacks_file_under_another_uid_is_not_signalled(procs, tmp_path, attacker, run_as, why) -> None:
    run_as = tuple(a.format(uid=attacker) for a in run_as)
    p, ring, stacks = start_holder(procs, tmp_path / "rings", owner=attacker, run_as=run_as)
    text, note = ask_for_stacks(p.pid, ring, timeout=1.0)
    assert text is None and note is not None
    assert f"could not be shown to be a traced process of the ring's owner (uid {attacker})" in note
    assert note.endswith(why.format(uid=attacker)), note
    assert p.poll() is None and os.path.getsize(stacks) == 0  # not signalled, its file not touched


@needs_root
@needs_setpriv
def test_the_same_holder_under_the_owners_uid_gives_its_stacks(procs, tmp_path, attacker) -> None:
    run_as = ("setpriv", f"--reuid={attacker}", f"--regid={attacker}", "--clear-groups", "--")
    p, ring, _ = start_holder(procs, tmp_path / "rings", owner=attacker, run_as=run_as)
    text, note = ask_for_stacks(p.pid, ring, timeout=5.0)
    assert note is None and text is not None and "holding_the_stacks_file" in text, text
    assert request_stacks(p.pid, ring) is not None
    assert p.poll() is None


def test_a_holder_that_does_not_catch_the_signal_is_not_signalled(procs, tmp_path) -> None:
    p, ring, stacks = start_holder(procs, tmp_path / "rings", catch=False)
    text, note = ask_for_stacks(p.pid, ring, timeout=1.0)
    assert text is None and note is not None
    assert note.endswith("it does not catch SIGUSR2 (the signal would end it)"), note
    assert p.poll() is None and os.path.getsize(stacks) == 0


def test_a_ring_naming_an_earlier_process_with_the_same_pid_is_not_signalled(procs, tmp_path) -> None:
    p, ring, stacks = start_holder(procs, tmp_path / "rings", ring_start_offset_s=-60.0)
    text, note = ask_for_stacks(p.pid, ring, timeout=1.0)
    assert text is None and note is not None and "not when its ring says" in note, note
    assert p.poll() is None and os.path.getsize(stacks) == 0


def test_a_process_that_does_not_hold_the_stacks_file_is_not_signalled(procs, tmp_path) -> None:
    # Catches the signal, but through a file of its own: the stacks file lingctl would read is not the one.
    p, ring, stacks = start_holder(procs, tmp_path / "rings")
    os.unlink(stacks)
    stacks.touch(mode=0o600)
    text, note = ask_for_stacks(p.pid, ring, timeout=1.0)
    assert text is None and note is not None and note.endswith("it does not hold its stacks file open"), note
    assert p.poll() is None
