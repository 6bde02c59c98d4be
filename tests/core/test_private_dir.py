"""lingctl.core.private_dir on real directories: ours, 0700, never through a link, files created exclusively."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from lingctl.core.errors import AccessDeniedError
from lingctl.core.private_dir import check_private_dir, create_exclusive, ensure_private_dir, open_nofollow

OTHER_UID = 65534  # nobody


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_fresh_directory_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = ensure_private_dir(tmp_path / "ring")
    finally:
        os.umask(old)
    assert made == tmp_path / "ring"
    assert mode(made) == 0o700 and os.lstat(made).st_uid == os.geteuid()
    ensure_private_dir(made)  # ours and private: accepted again as it is
    assert mode(made) == 0o700


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "ring").symlink_to(target, target_is_directory=True)
    with pytest.raises(AccessDeniedError, match="not a directory"):
        ensure_private_dir(tmp_path / "ring")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(AccessDeniedError, match="not a directory"):
        check_private_dir(tmp_path / "file")


def test_a_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "ring"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(AccessDeniedError, match="mode 0777") as info:
        ensure_private_dir(shared)
    assert info.value.hint == f"chmod 700 {shared}"
    assert mode(shared) == 0o777  # refused, not silently changed


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "ring"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(AccessDeniedError, match=f"belongs to uid {OTHER_UID}"):
        ensure_private_dir(planted)


def test_open_nofollow_refuses_a_symlink_and_leaves_its_target_alone(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(AccessDeniedError, match="symbolic link"):
        open_nofollow(tmp_path / "planted", os.O_WRONLY | os.O_TRUNC)
    assert victim.read_bytes() == b"precious"
    fd = open_nofollow(victim, os.O_RDONLY)  # a real file opens
    try:
        assert os.read(fd, 8) == b"precious"
    finally:
        os.close(fd)


def test_create_exclusive_fails_on_anything_already_there(tmp_path: Path) -> None:
    fd = create_exclusive(tmp_path / "lock")
    os.close(fd)
    assert mode(tmp_path / "lock") == 0o600
    with pytest.raises(FileExistsError):
        create_exclusive(tmp_path / "lock")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(OSError) as info:  # a link in place is "already there", not followed
        create_exclusive(tmp_path / "planted")
    assert info.value.errno == errno.EEXIST
    assert victim.read_bytes() == b"precious"
