"""Stacks of a traced process, and the rule for the signal that asks for them: only to a traced process of the
ring directory's owner, shown from what the kernel says about it.

Stacks come from a signal (``STACKS_SIGNAL``, SIGUSR2) whose default action ends a process. Which process to
signal is read from data its owner wrote: a ring header and a meta file name a pid and its start time, and the
start time of any process is world-readable. For root, whose signals reach every process, that would let any
local user aim root's ``timer diagnose`` or ``attach --stacks`` at any process. So before the signal lingctl
checks four facts that the kernel keeps and that a user who can write only their own files cannot forge for
another user's process:

1. **Its owner.** Its real, effective and saved uid (``/proc/PID/status``) are all the uid that owns the ring
   directory. A planted ring can then only reach a process its planter could signal anyway, never a
   process of root's or another user's, nor a set-uid program the planter started.
2. **Its start time** is the one its ring header records, so a later process that reuses the pid is not it.
3. **It catches the signal** (the ``SigCgt`` mask of ``/proc/PID/status``): the tracer registered
   ``faulthandler`` for it, so the signal makes it dump its stacks instead of ending it.
4. **It holds the stacks file open** (same device and inode in ``/proc/PID/fd``): the tracer opened that file
   when it registered ``faulthandler``. Nobody can put an open file into another process. Reading
   ``/proc/PID/fd`` needs the process's uid or root, so anything else fails closed.

The pidfd of the process is opened before the checks, and the signal goes through it. A process that ended
meanwhile cannot be signalled through it, and neither can one that took over its pid; without pidfds (Linux
before 5.3) the signal goes by pid right after the checks.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from lingctl.core.errors import LingctlError
from lingctl.timer.ring import RingReader, check_ring_dir, open_regular

STACKS_SIGNAL = signal.SIGUSR2


class NotProvenTraced(Exception):
    """The process could not be shown to be a traced process of the ring directory's owner: it was not signalled.
    The message says which fact failed."""


def dump_stacks(pid: int, path: Path, *, owner: int | None = None, timeout: float = 3.0) -> str | None:
    """Ask traced process ``pid`` for its stacks through its stacks file ``path`` (in the ring directory of
    ``owner``, default us): empty the file, signal the process, wait until the file is non-empty and its size
    holds still for a moment (faulthandler writes the dump in one burst from the signal handler). None when no
    complete dump came within ``timeout``. FileNotFoundError when there is no stacks file or ring (the process
    is not traced: the tracer removes its stacks file before it lets go of the signal).

    The file is opened once, without following links, and used only if it is a regular file of ``owner``
    with one link: emptying or reading a file planted in its place would touch someone else's data. The
    process is signalled only once ``signal_traced`` has shown it is a traced process of ``owner``,
    holding this very file open; ``NotProvenTraced`` otherwise, before the file is touched."""
    uid = os.geteuid() if owner is None else owner
    try:
        if not check_ring_dir(path.parent, uid):
            raise FileNotFoundError(errno.ENOENT, "no ring directory", str(path.parent))
    except LingctlError as err:  # not private to its owner: nothing in it proves anything
        raise NotProvenTraced(str(err)) from None
    try:
        fd = open_regular(path, os.O_RDWR, owner=owner)
    except LingctlError as err:
        raise FileNotFoundError(errno.ENOENT, str(err), str(path)) from None
    try:
        if os.fstat(fd).st_nlink != 1:
            raise FileNotFoundError(errno.ENOENT, f"{path} has other names; refusing to use it", str(path))
        started = _ring_start_time(path.parent / f"{pid}.ring", pid, owner)
        signal_traced(
            pid, STACKS_SIGNAL, owner=uid, create_time=started, stacks_fd=fd, prepare=lambda: os.ftruncate(fd, 0)
        )
        deadline, last = time.monotonic() + timeout, -1
        while time.monotonic() < deadline:
            time.sleep(0.05)
            size = os.fstat(fd).st_size
            if size > 0 and size == last:
                return os.pread(fd, size, 0).decode(errors="replace")
            last = size
        return None
    finally:
        os.close(fd)


def _ring_start_time(ring: Path, pid: int, owner: int | None) -> float:
    """The start time the ring of ``pid`` records (its tracer wrote it there from psutil)."""
    try:
        reader = RingReader(ring, owner=owner)
    except ValueError as err:  # not a ring, or not a regular file of the owner
        raise FileNotFoundError(errno.ENOENT, str(err), str(ring)) from None
    try:
        h = reader.header()
    finally:
        reader.close()
    if h.pid != pid:
        raise NotProvenTraced(f"its ring {ring} names pid {h.pid}")
    return h.create_time


def signal_traced(
    pid: int,
    sig: int,
    *,
    owner: int,
    create_time: float,
    stacks_fd: int,
    prepare: Callable[[], object] | None = None,
) -> None:
    """Send ``sig`` to ``pid`` only once it is shown to be a traced process of ``owner`` (the module doc);
    ``prepare`` runs between the checks and the signal (emptying the stacks file: untouched on a refusal).
    ``NotProvenTraced`` when it is not shown, ``ProcessLookupError`` when it has gone."""
    pidfd = _pidfd_open(pid)
    try:
        check_traced(pid, sig, owner=owner, create_time=create_time, stacks_fd=stacks_fd)
        if prepare is not None:
            prepare()
        if pidfd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(pidfd, sig)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def check_traced(pid: int, sig: int, *, owner: int, create_time: float, stacks_fd: int) -> None:
    """Each fact of the module doc, cheapest first; ``NotProvenTraced`` naming the first that fails."""
    import psutil

    status = _status(pid)
    real, effective, saved = (int(x) for x in status.get("Uid", "-1 -1 -1").split()[:3])
    if (real, effective, saved) != (owner, owner, owner):
        others = f" (effective {effective}, saved {saved})" if (effective, saved) != (real, real) else ""
        raise NotProvenTraced(f"it runs as uid {real}{others}")
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        raise ProcessLookupError(pid) from None
    if abs(started - create_time) >= 0.01:
        raise NotProvenTraced(f"it started at {started:.2f}, not when its ring says ({create_time:.2f})")
    if not int(status.get("SigCgt", "0"), 16) >> (sig - 1) & 1:
        raise NotProvenTraced(f"it does not catch {signal.Signals(sig).name} (the signal would end it)")
    if not _holds_open(pid, stacks_fd):
        raise NotProvenTraced("it does not hold its stacks file open")


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid``; None where the kernel or Python has none. ``ProcessLookupError`` when it is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):
        return None


def _status(pid: int) -> dict[str, str]:
    """The fields of ``/proc/PID/status`` (readable by everyone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except OSError as exc:
        raise NotProvenTraced(f"its /proc status is not readable ({exc.strerror})") from None
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _holds_open(pid: int, fd: int) -> bool:
    """Whether ``pid`` has a descriptor on the file ``fd`` (ours) is open on: same device and inode."""
    st = os.fstat(fd)
    want = (st.st_dev, st.st_ino)
    try:
        entries = list(os.scandir(f"/proc/{pid}/fd"))
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except OSError as exc:
        raise NotProvenTraced(f"its open files are not readable ({exc.strerror})") from None
    for entry in entries:
        try:
            held = os.stat(entry.path)  # the file the descriptor is open on (a stat, never an open)
        except OSError:  # closed meanwhile
            continue
        if (held.st_dev, held.st_ino) == want:
            return True
    return False
