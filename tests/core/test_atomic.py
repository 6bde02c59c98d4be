from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lingctl.core.atomic import FOREIGN_STALE_S, TMP_MARKER, atomic_write, is_tmp_name, sweep_stale, tmp_prefix


def test_replaces_only_on_success(tmp_path) -> None:
    target = tmp_path / "sub" / "file.bin"
    with atomic_write(target) as (tmp, f):
        f.write(b"complete")
        assert TMP_MARKER in tmp.name and not target.exists()
    assert target.read_bytes() == b"complete"


def test_failure_keeps_previous_content_and_leaves_no_temp(tmp_path) -> None:
    target = tmp_path / "file.bin"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as (_, f):
            f.write(b"half")
            raise RuntimeError("connection lost")
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


def test_temporary_names_carry_host_and_pid_and_fit_long_targets(tmp_path) -> None:
    long_name = "n" * 250  # near NAME_MAX: the temporary name must still be creatable
    with atomic_write(tmp_path / long_name) as (tmp, f):
        f.write(b"x")
        assert is_tmp_name(tmp.name) and f"-{os.getpid()}-" in tmp.name
    assert (tmp_path / long_name).read_bytes() == b"x"
    assert not is_tmp_name(f"notes{TMP_MARKER}v2.txt")  # merely containing the marker is not enough


def test_sweep_removes_only_temporary_files_of_dead_writers(tmp_path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    host = tmp_prefix("x").split(TMP_MARKER)[1].split("-")[0]
    sub = tmp_path / "sub"
    sub.mkdir()
    stale = sub / f".data.bin{TMP_MARKER}{host}-{dead_pid}-abcd1234"
    live = tmp_path / f".data.bin{TMP_MARKER}{host}-{os.getpid()}-abcd1234"  # this process: still writing
    parent = tmp_path / f".other{TMP_MARKER}{host}-{os.getppid()}-zz_z9999"  # a live process
    foreign_new = tmp_path / f".f{TMP_MARKER}000000-{dead_pid}-abcd1234"  # another machine, fresh
    foreign_old = tmp_path / f".g{TMP_MARKER}000000-{dead_pid}-abcd1234"  # another machine, abandoned
    user = tmp_path / f"report{TMP_MARKER}{host}-{dead_pid}-abcd1234.txt"  # the user's, despite the marker
    skipped = tmp_path / ".state" / stale.name
    skipped.parent.mkdir()
    for path in (stale, live, parent, foreign_new, foreign_old, user, skipped):
        path.write_bytes(b"partial")
    os.utime(foreign_old, (0, time.time() - FOREIGN_STALE_S - 60))
    link = tmp_path / f".h{TMP_MARKER}{host}-{dead_pid}-abcd1234"
    link.symlink_to(user)  # never unlink through or as a symlink
    removed = sweep_stale(tmp_path, skip_dirs={".state"})
    assert sorted(removed) == sorted([stale, foreign_old])
    assert all(p.exists() for p in (live, parent, foreign_new, user, skipped)) and link.is_symlink()
