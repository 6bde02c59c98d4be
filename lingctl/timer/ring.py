"""The per-process trace ring: fixed-size binary records in a shared-memory file that other processes read.

One traced process owns one ring, ``<ring dir>/<pid>.ring`` (file 0600), removed when the process exits; rings
of dead processes are collected by the next tracer (``collect_stale``). The file is a 4 KiB header then
``capacity`` records of 32 bytes.

The ring directory is ``$LINGCTL_TIMER_DIR`` when set, else ``/dev/shm/lingctl-timer-<uid>`` (``$TMPDIR``
instead of ``/dev/shm`` where there is none). Its name is predictable and its parent writable by everyone, so
another local user could create it first and plant symlinks in it: it is used only when it is a real
directory owned by this user with mode 0700 (``core.private_dir``), and every file in it is opened without
following links and created with ``O_EXCL``. Writers and readers refuse anything else with one line.

Writing a record is one ``struct.pack_into`` into the mmap plus an index bump: no syscall, no allocation,
no lock beyond the GIL (one writer per process; records from other threads go through the same call, and
a reader that races a write re-reads). ``attach`` and ``diagnose`` read the header (heartbeat, step,
what the process is inside right now, last sequence number per process group) and the newest records.

Header layout (little-endian):

====== ==================== ===========================================================================
offset field                meaning
====== ==================== ===========================================================================
0      magic  8s            ``LGTIMER1``
8      version, hdr u32 x2  format version, header size
16     pid q, create_time d process id and its start time (psutil), so a reused pid is not mistaken
32     rank, world, local i x3, pad i
48     capacity Q           records in the ring
56     write_index Q        records written so far (slot = index % capacity)
64     heartbeat_ns q       monotonic clock, bumped by the tracer's background thread
72     mono_anchor_ns q     ``time.monotonic_ns()`` ...
80     wall_anchor_ns q     ... and ``time.time_ns()`` read together: aligns the ranks' clocks
88     step q               steps finished (``Optimizer.step`` calls)
96     step_start_ns q      when the current step began
104    cur_kind B, cur_op B, cur_group H, cur_seq i   what the main thread is inside now (kind 0: nothing traced)
112    cur_since_ns q       since when
120    enabled B, pad 7     0 once tracing disabled itself after an internal error
128    argv 256s            the command line, NUL padded
384    groups 32 x 64       per process group: name 32s, size i, last_op B, pad 3,
                            started_seq q, started_ns q, completed_seq q (in flight: started > completed)
====== ==================== ===========================================================================

A record is ``kind B, op B, group H, seq i, start_ns q, end_ns q, value q``: one finished traced call
(``seq``: the collective's sequence number in its group, or the step number; ``value``: bytes moved, or 0).
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
import secrets
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.errors import AccessDeniedError, os_error
from lingctl.core.private_dir import check_private_dir, create_exclusive, ensure_private_dir, open_nofollow

MAGIC = b"LGTIMER1"
VERSION = 1
HEADER_SIZE = 4096
RECORD = struct.Struct("<BBHiqqq")
RECORD_SIZE = RECORD.size  # 32
MAX_GROUPS = 32
GROUP = struct.Struct("<32siB3xqqq")  # 64 bytes
GROUPS_OFFSET = 384
NO_GROUP = 0xFFFF

_GROUP_START = struct.Struct("<B3xqq")  # last_op, started_seq, started_ns: one write per collective
_GROUP_DONE = struct.Struct("<q")
_FIXED = struct.Struct("<8sII q d iiii QQ qqq qq BBHi q B7x 256s")


class Kind(enum.IntEnum):
    STEP = 1
    FORWARD = 2
    BACKWARD = 3
    OPTIMIZER = 4
    DATA = 5
    COLLECTIVE = 6
    P2P = 7
    COPY = 8
    GPU = 9


class Op(enum.IntEnum):
    NONE = 0
    ALL_REDUCE = 1
    BROADCAST = 2
    ALL_GATHER = 3
    REDUCE_SCATTER = 4
    BARRIER = 5
    ALL_TO_ALL = 6
    REDUCE = 7
    GATHER = 8
    SCATTER = 9
    SEND = 10
    RECV = 11


@dataclass(slots=True)
class Record:
    kind: int
    op: int
    group: int
    seq: int
    start_ns: int
    end_ns: int
    value: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class GroupState:
    index: int
    name: str
    size: int
    last_op: int
    in_flight: bool
    started_seq: int  # sequence number of the last collective entered (-1: none yet)
    completed_seq: int  # ... and of the last one that returned
    started_ns: int


@dataclass(slots=True)
class Header:
    pid: int
    create_time: float
    rank: int
    world: int
    local_rank: int
    capacity: int
    write_index: int
    heartbeat_ns: int
    mono_anchor_ns: int
    wall_anchor_ns: int
    step: int
    step_start_ns: int
    cur_kind: int
    cur_op: int
    cur_group: int
    cur_seq: int
    cur_since_ns: int
    enabled: bool
    argv: str
    groups: list[GroupState]

    def to_wall_ns(self, mono_ns: int) -> int:
        """A monotonic timestamp of this process on the wall clock (to merge ranks on one timeline)."""
        return mono_ns - self.mono_anchor_ns + self.wall_anchor_ns


DIR_ENV = "LINGCTL_TIMER_DIR"


def ring_dir() -> Path:
    """Where this user's rings live: ``$LINGCTL_TIMER_DIR``, else ``lingctl-timer-<uid>`` in shared memory."""
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override)
    return user_ring_dir(os.getuid())


def user_ring_dir(uid: int) -> Path:
    """The default ring directory of user ``uid`` (root looks there for other users' rings)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"lingctl-timer-{uid}"


def ensure_ring_dir(path: Path | None = None) -> Path:
    """Create the ring directory (0700) or check the one that is there is private to us; refused otherwise."""
    path = ring_dir() if path is None else Path(path)
    try:
        return ensure_private_dir(path)
    except AccessDeniedError as err:
        raise _with_hint(err, path) from None


def _with_hint(err: AccessDeniedError, path: Path) -> AccessDeniedError:
    if err.hint and "TMPDIR" in err.hint:  # for rings the way out is the ring directory's own variable
        err.hint = f"remove {path} (it is not lingctl's) or set {DIR_ENV} to a directory of your own"
    return err


def check_ring_dir(path: Path, uid: int | None = None) -> bool:
    """Whether ``path`` exists (False: not there) after checking it is private to ``uid`` (default: us): a
    real directory, not a link, owned by ``uid``, no access for others. Anything else is refused with an
    ``AccessDeniedError``: a directory another user controls may hold planted links."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    try:
        check_private_dir(path, owner=uid)
    except AccessDeniedError as err:
        raise _with_hint(err, path) from None
    return True


def open_regular(path: Path, flags: int, *, owner: int | None = None) -> int:
    """A descriptor on ``path``, opened without following a link, that is a regular file owned by ``owner``
    (default: us). O_NONBLOCK so that a FIFO put in its place cannot hang the open."""
    fd = open_nofollow(path, flags | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        expected = os.geteuid() if owner is None else owner
        if not stat.S_ISREG(st.st_mode) or st.st_uid != expected:
            raise AccessDeniedError(f"{path} is not a regular file of uid {expected}; refusing to use it")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def remove_own_file(path: Path) -> None:
    """Remove ``path`` if it is a regular file of ours (a leftover of an earlier process with the same pid);
    refuse anything else in its place (a link, a directory, another user's file) with ``AccessDeniedError``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file of this user"
        raise AccessDeniedError(f"{path} is {kind}; refusing to replace it", hint=f"remove {path}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def ring_path(pid: int) -> Path:
    return ring_dir() / f"{pid}.ring"


class RingWriter:
    """The traced process's side. Not thread-safe beyond what the GIL gives a single ``pack_into``."""

    def __init__(
        self, path: Path, *, capacity: int, rank: int = 0, world: int = 1, local_rank: int = 0, argv: str = ""
    ) -> None:
        import psutil

        self.path = Path(path)
        self.capacity = capacity
        ensure_ring_dir(self.path.parent)
        size = HEADER_SIZE + capacity * RECORD_SIZE
        # Written under a fresh temporary name (created exclusively: nothing planted can be reused) and renamed:
        # a reader (or collect_stale) never sees a ring whose header is not there yet. The rename replaces
        # whatever has the final name, a link included, without following it.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            fd = create_exclusive(tmp, os.O_RDWR, 0o600)
        except OSError as exc:
            raise os_error(exc, str(tmp)) from exc
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        pid = os.getpid()
        mono, wall = time.monotonic_ns(), time.time_ns()
        _FIXED.pack_into(
            self.mm,
            0,
            MAGIC,
            VERSION,
            HEADER_SIZE,
            pid,
            psutil.Process(pid).create_time(),
            rank,
            world,
            local_rank,
            0,
            capacity,
            0,
            mono,
            mono,
            wall,
            0,
            mono,
            0,
            0,
            NO_GROUP,
            0,
            0,
            1,
            argv.encode()[:255],
        )
        os.replace(tmp, self.path)
        self.index = 0
        self.groups: dict[str, int] = {}

    # -- records ----------------------------------------------------------------------------------
    def append(self, kind: int, op: int, group: int, seq: int, start_ns: int, end_ns: int, value: int = 0) -> None:
        i = self.index
        RECORD.pack_into(
            self.mm, HEADER_SIZE + (i % self.capacity) * RECORD_SIZE, kind, op, group, seq, start_ns, end_ns, value
        )
        self.index = i + 1
        struct.pack_into("<Q", self.mm, 56, i + 1)

    # -- live state -------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        struct.pack_into("<q", self.mm, 64, time.monotonic_ns())

    def set_rank(self, rank: int, world: int, local_rank: int) -> None:
        struct.pack_into("<iii", self.mm, 32, rank, world, local_rank)

    def set_step(self, step: int, start_ns: int) -> None:
        struct.pack_into("<qq", self.mm, 88, step, start_ns)

    def enter(self, kind: int, op: int = 0, group: int = NO_GROUP, seq: int = 0, now_ns: int | None = None) -> None:
        struct.pack_into(
            "<BBHiq", self.mm, 104, kind, op, group, seq, time.monotonic_ns() if now_ns is None else now_ns
        )

    def leave(self) -> None:
        struct.pack_into("<BBHiq", self.mm, 104, 0, 0, NO_GROUP, 0, 0)

    def disable(self) -> None:
        struct.pack_into("<B", self.mm, 120, 0)

    def group_index(self, name: str, size: int) -> int:
        """The header slot of a process group (registered on first use; NO_GROUP past MAX_GROUPS)."""
        index = self.groups.get(name)
        if index is None:
            if len(self.groups) >= MAX_GROUPS:
                return NO_GROUP
            index = self.groups[name] = len(self.groups)
            GROUP.pack_into(self.mm, GROUPS_OFFSET + index * GROUP.size, name.encode()[:31], size, 0, -1, 0, -1)
        return index

    def group_started(self, index: int, op: int, seq: int, now_ns: int) -> None:
        if index != NO_GROUP:
            _GROUP_START.pack_into(self.mm, GROUPS_OFFSET + index * GROUP.size + 36, op, seq, now_ns)

    def group_completed(self, index: int, seq: int) -> None:
        if index != NO_GROUP:
            _GROUP_DONE.pack_into(self.mm, GROUPS_OFFSET + index * GROUP.size + 56, seq)

    def close(self, *, remove: bool = True) -> None:
        try:
            self.mm.close()
        finally:
            if remove:
                self.path.unlink(missing_ok=True)


class RingReader:
    """Another process's view of a ring (read-only mmap)."""

    def __init__(self, path: Path, *, owner: int | None = None) -> None:
        """Map ``path`` read-only: never through a link, only a regular file of ``owner`` (default: us).
        ``OSError`` when it cannot be opened, ``ValueError`` when it is not a ring."""
        self.path = Path(path)
        try:
            fd = open_regular(self.path, os.O_RDONLY, owner=owner)
        except AccessDeniedError as err:
            raise ValueError(str(err)) from None
        try:
            if os.fstat(fd).st_size < HEADER_SIZE:
                raise ValueError(f"{self.path} is not a lingctl timer ring (too short)")
            self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if self.mm[:8] != MAGIC:
            self.mm.close()
            raise ValueError(f"{self.path} is not a lingctl timer ring")

    def header(self) -> Header:
        f = _FIXED.unpack_from(self.mm, 0)
        groups = []
        for i in range(MAX_GROUPS):
            name, size, last_op, started, started_ns, completed = GROUP.unpack_from(
                self.mm, GROUPS_OFFSET + i * GROUP.size
            )
            name = name.rstrip(b"\0").decode(errors="replace")
            if not name and size == 0:
                break
            groups.append(GroupState(i, name, size, last_op, started > completed, started, completed, started_ns))
        return Header(
            pid=f[3],
            create_time=f[4],
            rank=f[5],
            world=f[6],
            local_rank=f[7],
            capacity=f[9],
            write_index=f[10],
            heartbeat_ns=f[11],
            mono_anchor_ns=f[12],
            wall_anchor_ns=f[13],
            step=f[14],
            step_start_ns=f[15],
            cur_kind=f[16],
            cur_op=f[17],
            cur_group=f[18],
            cur_seq=f[19],
            cur_since_ns=f[20],
            enabled=bool(f[21]),
            argv=f[22].rstrip(b"\0").decode(errors="replace"),
            groups=groups,
        )

    def records(self, since: int = 0) -> tuple[list[Record], int]:
        """Records with index >= ``since`` still in the ring (older ones were overwritten), and the index to
        pass next time."""
        end = struct.unpack_from("<Q", self.mm, 56)[0]
        capacity = struct.unpack_from("<Q", self.mm, 48)[0]
        start = max(since, end - capacity + 1)  # keep one slot of margin against a concurrent overwrite
        out = [
            Record(*RECORD.unpack_from(self.mm, HEADER_SIZE + (i % capacity) * RECORD_SIZE)) for i in range(start, end)
        ]
        return out, end

    def close(self) -> None:
        self.mm.close()


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return create_time is None or abs(proc.create_time() - create_time) < 0.01
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def collect_stale() -> list[Path]:
    """Remove rings whose process is gone (killed with SIGKILL, so its exit hook never ran), and temporary
    rings such processes left. Only in a ring directory that is ours (``AccessDeniedError`` otherwise); what
    is removed is unlinked, never followed (unlinking a link removes the link alone)."""
    removed: list[Path] = []
    d = ring_dir()
    if not check_ring_dir(d):
        return removed
    for path in d.glob("*.ring"):
        try:
            reader = RingReader(path)
            try:
                h = reader.header()
            finally:
                reader.close()
            alive = pid_alive(h.pid, h.create_time)
        except (OSError, ValueError, struct.error):
            alive = False
        if not alive:
            _unlink(path)
            _unlink(path.with_suffix(".stacks"))
            removed.append(path)
    for path in d.glob(".*.ring.*.tmp"):  # .<pid>.ring.<writer pid>.<token>.tmp of a writer killed mid-creation
        writer = path.name.split(".")[3]
        if not (writer.isdigit() and pid_alive(int(writer))):
            _unlink(path)
            removed.append(path)
    return removed


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.EPERM):  # a directory in its place is left alone
            raise
