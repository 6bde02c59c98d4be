"""Atomic file writes: a temporary file beside the target, fsync, rename, fsync of the directory.

Used wherever a half-written file would be mistaken for a finished one (downloads, checkpoints, outputs):
after a crash the target holds either its previous content or the complete new content, never a prefix.

Temporary files are named ``.<target>.lingctl-tmp-<host>-<pid>-<random>``: ``host`` is a short hash of the
machine's name and ``pid`` the writing process, so a later run can tell a file that a dead lingctl process
left behind (kill -9, a crash) from one that a live process is still writing, and from a user's file that
merely contains the marker. ``sweep_stale`` removes only the first kind.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from lingctl.core.errors import os_error

# Temporary files of unfinished writes carry this marker; listings skip them.
TMP_MARKER = ".lingctl-tmp-"
# The target's name is cut to this many bytes inside the temporary name, so that a target whose name is
# near NAME_MAX (255) still gets a temporary file (the marker, host, pid and random part add ~40 bytes).
_STEM_BYTES = 180
# host (6 hex) - pid - 8 characters of mkstemp's or uuid's alphabet, at the very end of the name.
_TMP_RE = re.compile(
    r"^\..*" + re.escape(TMP_MARKER) + r"(?P<host>[0-9a-f]{6})-(?P<pid>[1-9][0-9]{0,9})-[a-z0-9_]{8}$", re.DOTALL
)
# A temporary file of another machine (a shared file system) is removed only once it is this old: its
# owner cannot be asked whether it is alive. Writes at offsets keep a file in progress fresh.
FOREIGN_STALE_S = 24 * 3600.0


def host_tag() -> str:
    """A short, stable tag of this machine (6 hex digits) for names that record who wrote them."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=3).hexdigest()


def tmp_prefix(target_name: str) -> str:
    """The temporary-name prefix for a file that will be renamed to ``target_name`` (8 random characters
    follow it)."""
    stem = os.fsdecode(os.fsencode(target_name)[:_STEM_BYTES])
    return f".{stem}{TMP_MARKER}{host_tag()}-{os.getpid()}-"


def tmp_path(target: Path) -> Path:
    """A fresh temporary path beside ``target`` (not created)."""
    return target.parent / f"{tmp_prefix(target.name)}{uuid.uuid4().hex[:8]}"


def is_tmp_name(name: str) -> bool:
    """Whether ``name`` is exactly a temporary name lingctl makes (not merely one containing the marker)."""
    return _TMP_RE.match(name) is not None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (when in doubt: yes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError:
        return True  # cannot tell: keep the file
    return True


def is_stale_tmp(name: str, mtime: float, *, now: float | None = None) -> bool:
    """A lingctl temporary file whose writer is gone: on this machine its pid is dead; from another machine
    it has not been written for ``FOREIGN_STALE_S``."""
    m = _TMP_RE.match(name)
    if m is None:
        return False
    pid = int(m["pid"])
    if m["host"] == host_tag():
        return pid != os.getpid() and not pid_alive(pid)
    return (now if now is not None else time.time()) - mtime > FOREIGN_STALE_S


def sweep_stale(root: Path, *, skip_dirs: Iterable[str] = ()) -> list[Path]:
    """Remove the stale lingctl temporary files under ``root`` (see ``is_stale_tmp``); returns them.

    Regular files only (never a symlink or a directory); symlinked directories are not followed and
    unreadable directories are passed over: the sweep is housekeeping and must not fail a run.
    """
    skip = frozenset(skip_dirs)
    removed: list[Path] = []
    now = time.time()
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            if TMP_MARKER not in name:
                continue
            path = Path(directory) / name
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and is_stale_tmp(name, st.st_mtime, now=now):
                    path.unlink()
                    removed.append(path)
            except OSError:
                continue  # vanished, or not ours to remove
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_tmp(target: Path) -> tuple[Path, int]:
    """A new temporary file beside ``target`` (its directory created), open for writing: (path, fd).

    Created with mode 0666 less the umask, as the finished file should be; ``mkstemp``'s 0600 would leave
    every copied file private."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(16):
            tmp = tmp_path(target)
            try:
                return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            except FileExistsError:
                continue
        raise FileExistsError(f"no free temporary name beside {target}")
    except OSError as exc:
        raise os_error(exc, str(target)) from exc


def set_mtime(path: Path, mtime: float | None, mtime_ns: int | None = None) -> None:
    """Give ``path`` the modification time ``mtime_ns`` (exact) or ``mtime``; neither: leave it."""
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    elif mtime is not None:
        os.utime(path, (mtime, mtime))


def commit_tmp(tmp: Path, target: Path, *, mtime: float | None = None, mtime_ns: int | None = None) -> None:
    """Finish an atomic write: fsync the temporary file, give it ``mtime``, rename it over ``target``, and
    make the rename durable. The caller removes ``tmp`` if this raises."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    set_mtime(tmp, mtime, mtime_ns)  # size + mtime equal to the source is how a re-sync skips it
    os.replace(tmp, target)
    fsync_dir(target.parent)


@contextmanager
def atomic_write(
    path: Path, *, mtime: float | None = None, mtime_ns: int | None = None
) -> Iterator[tuple[Path, BinaryIO]]:
    """Yield ``(tmp_path, file)``; on clean exit the file replaces ``path`` (with ``mtime``, when given), on
    an exception it is removed.

    Raising inside the block (a failed verification, a broken connection, a full disk) leaves ``path``
    untouched and no temporary file behind.
    """
    path = Path(path)
    tmp, fd = create_tmp(path)
    done = False
    try:
        with os.fdopen(fd, "wb") as f:
            yield tmp, f
            f.flush()
            os.fsync(f.fileno())
        set_mtime(tmp, mtime, mtime_ns)
        os.replace(tmp, path)
        done = True
        fsync_dir(path.parent)
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    finally:
        if not done:
            tmp.unlink(missing_ok=True)
