"""Drills for the ring directory, a predictable name in a place every user can write to (``/dev/shm``).

Another local user could create ``lingctl-timer-<uid>`` first, or plant links in it, to make a traced process
truncate or create files elsewhere. The tests point the ring directory at a temporary one
(``LINGCTL_TIMER_DIR``) and play that user's part with what a test can do: a directory open to everyone, a
directory that is a link, links planted under every name the tracer creates or opens, and (as root) a
directory owned by another uid. After each, the victim file is byte for byte and mode for mode what it was,
and nothing appears where a link pointed.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lingctl.core.errors import AccessDeniedError
from lingctl.timer.ring import DIR_ENV, RingReader, RingWriter, collect_stale, ring_path
from lingctl.timer.tracer import Tracer, collect_stale_files, read_stacks, stacks_path

REPO = Path(__file__).resolve().parents[2]
VICTIM_BYTES = b"precious: not lingctl's\n"


@pytest.fixture
def rings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ring directory for this test (not created yet), under a shared-looking parent."""
    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv(DIR_ENV, str(shared / "lingctl-timer-test"))
    return shared / "lingctl-timer-test"


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file of someone else's that a planted link points at; unchanged at the end of every test."""
    path = tmp_path / "victim"
    path.write_bytes(VICTIM_BYTES)
    path.chmod(0o600)
    before = os.stat(path)
    yield path
    after = os.stat(path)
    assert path.read_bytes() == VICTIM_BYTES
    assert (stat.S_IMODE(after.st_mode), after.st_ino, after.st_size) == (0o600, before.st_ino, len(VICTIM_BYTES))


def start_tracer() -> Tracer:
    """The real tracer in this process, patching nothing (no targets): ring, lock, stacks file, thread."""
    return Tracer(None, set(), 256, 1 << 20)


def lingctl_env(rings: Path) -> dict[str, str]:
    return {**os.environ, DIR_ENV: str(rings), "PYTHONPATH": str(REPO)}


# -- a ring directory that is not ours ------------------------------------------------------------------------
def test_a_ring_directory_open_to_others_is_refused_by_writers_and_readers(rings: Path, tmp_path: Path) -> None:
    from lingctl.commands.timer import app

    rings.mkdir()
    rings.chmod(0o777)
    for attempt in (
        start_tracer,
        lambda: RingWriter(ring_path(os.getpid()), capacity=16),
        collect_stale,
        collect_stale_files,
    ):
        with pytest.raises(AccessDeniedError, match="open to other users"):
            attempt()
    attached = CliRunner().invoke(app, ["attach", "--pid", str(os.getpid()), "--once"])
    assert isinstance(attached.exception, AccessDeniedError) and attached.exception.exit_code == 1
    assert stat.S_IMODE(os.stat(rings).st_mode) == 0o777 and list(rings.iterdir()) == []  # refused, not "fixed"

    marker = tmp_path / "ran"  # `timer run` refuses before it starts the command
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lingctl",
            "timer",
            "run",
            "--out",
            str(tmp_path / "out"),
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        env=lingctl_env(rings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"lingctl: error: {rings} is open to other users (mode 0777); refusing to use it"
    assert lines[1:] == [f"hint: chmod 700 {rings}"]
    assert not marker.exists() and list(rings.iterdir()) == []


def test_a_ring_directory_that_is_a_link_is_refused(rings: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)  # private and ours: still refused, the name itself must be the directory
    rings.symlink_to(elsewhere)
    with pytest.raises(AccessDeniedError, match="is not a directory") as err:
        start_tracer()
    assert err.value.hint is not None and DIR_ENV in err.value.hint
    with pytest.raises(AccessDeniedError):
        collect_stale()
    from lingctl.timer.attach import find_ring

    with pytest.raises(AccessDeniedError):
        find_ring(os.getpid())
    assert list(elsewhere.iterdir()) == [] and rings.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another uid")
def test_a_ring_directory_owned_by_another_user_is_refused(rings: Path) -> None:
    rings.mkdir(mode=0o700)
    os.chown(rings, 12345, 12345)
    with pytest.raises(AccessDeniedError, match="belongs to uid 12345"):
        start_tracer()
    with pytest.raises(AccessDeniedError, match="belongs to uid 12345"):
        collect_stale()
    assert list(rings.iterdir()) == []


def test_a_new_ring_directory_is_private(rings: Path) -> None:
    tracer = start_tracer()
    try:
        st = os.lstat(rings)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        for path in (ring_path(os.getpid()), stacks_path(os.getpid()), rings / ".lock"):
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path
    finally:
        tracer.close()
    assert not ring_path(os.getpid()).exists() and not stacks_path(os.getpid()).exists()


# -- links planted in our own directory -----------------------------------------------------------------------
@pytest.mark.parametrize("name", [".lock", "{pid}.stacks"])
def test_a_link_planted_where_the_tracer_creates_a_file_is_refused(
    rings: Path, victim: Path, tmp_path: Path, name: str
) -> None:
    rings.mkdir(mode=0o700)
    planted = rings / name.format(pid=os.getpid())
    planted.symlink_to(victim)
    with pytest.raises(AccessDeniedError, match="symbolic link"):
        start_tracer()
    dangling = tmp_path / "chosen-by-attacker"
    planted.unlink()
    planted.symlink_to(dangling)  # a link to a file that does not exist yet must not create it
    with pytest.raises(AccessDeniedError, match="symbolic link"):
        start_tracer()
    assert not os.path.lexists(dangling)
    assert not os.path.lexists(ring_path(os.getpid()))  # nothing left behind by the refused start


def test_links_at_the_ring_and_temporary_names_are_replaced_not_followed(rings: Path, victim: Path) -> None:
    rings.mkdir(mode=0o700)
    pid = os.getpid()
    ring_path(pid).symlink_to(victim)
    old_tmp = rings / f".{pid}.ring.{pid}.tmp"  # the temporary name an earlier version used
    old_tmp.symlink_to(victim)
    tracer = start_tracer()
    try:
        assert not ring_path(pid).is_symlink() and RingReader(ring_path(pid)).header().pid == pid
    finally:
        tracer.close()
    assert old_tmp.is_symlink()  # left as it was: a link is never opened


def test_a_stale_stacks_file_of_ours_is_replaced_and_stacks_still_work(rings: Path) -> None:
    rings.mkdir(mode=0o700)
    stale = stacks_path(os.getpid())
    stale.write_bytes(b"stacks of an earlier process with this pid\n")
    tracer = start_tracer()
    try:
        assert os.lstat(stale).st_size == 0 and stat.S_IMODE(os.lstat(stale).st_mode) == 0o600
        text = read_stacks(os.getpid())
        assert "test_a_stale_stacks_file_of_ours_is_replaced" in text
    finally:
        tracer.close()


def test_readers_never_follow_links(rings: Path, victim: Path, tmp_path: Path) -> None:
    from lingctl.timer.attach import find_ring, request_stacks

    rings.mkdir(mode=0o700)
    tracer = start_tracer()
    pid = os.getpid()
    try:
        copy = tmp_path / "ring-copy"  # a real ring, reached through a link: not read
        copy.write_bytes(ring_path(pid).read_bytes())
        stacks_path(pid).unlink()
        stacks_path(pid).symlink_to(victim)
        with pytest.raises(FileNotFoundError):
            read_stacks(pid)  # would have emptied the victim
        assert request_stacks(pid, ring_path(pid)) is None
        os.unlink(ring_path(pid))
        ring_path(pid).symlink_to(copy)
        with pytest.raises(ValueError, match="symbolic link"):
            RingReader(ring_path(pid))
        assert find_ring(pid) is None
    finally:
        tracer.close()

    dead = 2**22 + 4321  # no such process: its leftovers are collected, links removed without being followed
    (rings / f"{dead}.ring").symlink_to(victim)
    (rings / f"{dead}.stacks").symlink_to(victim)
    (rings / f".{dead}.ring.{dead}.0123abcd.tmp").write_bytes(b"half-made ring")
    removed = collect_stale_files()
    assert {p.name for p in removed} >= {f"{dead}.ring", f".{dead}.ring.{dead}.0123abcd.tmp"}
    assert not any(os.path.lexists(rings / n) for n in (f"{dead}.ring", f"{dead}.stacks"))


def test_timer_run_with_a_planted_lock_link_runs_untraced_and_touches_nothing(
    rings: Path, victim: Path, tmp_path: Path
) -> None:
    rings.mkdir(mode=0o700)
    (rings / ".lock").symlink_to(victim)
    marker = tmp_path / "ran"
    code = f"from lingctl.timer.tracer import current; open({str(marker)!r}, 'w').write(str(current()))"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lingctl",
            "timer",
            "run",
            "--out",
            str(tmp_path / "out"),
            "--",
            sys.executable,
            "-c",
            code,
        ],
        env=lingctl_env(rings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "None"  # the program ran, untraced
    assert f"lingctl timer: tracing not installed: {rings / '.lock'} is a symbolic link" in r.stderr
    assert sorted(p.name for p in rings.iterdir()) == [".lock"]
