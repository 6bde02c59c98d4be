"""What diagnosis reads of each rank, whether from a live ring or from the log it left.

Live ranks are read from their rings (fresh state). A process killed with SIGKILL leaves its ring behind until
the next tracer collects it: that ring still says what the process was inside when it stopped (a forward, a
collective), so it is read as the live ones are, with its last heartbeat standing for "now". Ranks that
finished, or whose ring is gone, are read from their logs, which hold only completed calls: for them "started"
is their last completed collective, and where they were can only be their last *finished* call.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from lingctl.core.errors import NotFoundError
from lingctl.timer.attach import find_ring
from lingctl.timer.ring import Header, Kind, Record, RingReader, pid_alive


@dataclass(slots=True)
class GroupSeq:
    """One rank's position in one process group."""

    started_seq: int
    completed_seq: int
    in_flight: bool
    started_ns: int  # monotonic clock of that rank
    last_op: int
    size: int = 0


@dataclass(slots=True)
class RankData:
    """Everything the analysis needs from one rank, whether read from a live ring or from its log."""

    rank: int
    pid: int | None
    world: int
    records: list[Record]
    group_names: dict[int, str]  # header index -> group name
    groups: dict[str, GroupSeq]  # by name
    mono_anchor_ns: int
    wall_anchor_ns: int
    source: str = "ring"  # "ring" (live) or "log"
    alive: bool = True
    hostname: str | None = None
    header: Header | None = None
    ring: Path | None = None
    stopped_ns: int | None = None  # a dead process's ring: its last heartbeat (its clock's "now" when it stopped)

    def to_wall_ns(self, mono_ns: int) -> int:
        return mono_ns - self.mono_anchor_ns + self.wall_anchor_ns


def from_ring(path: Path, *, hostname: str | None = None, owner: int | None = None) -> RankData:
    """A live rank from its ring (``owner``: the ring's user, default us)."""
    reader = RingReader(path, owner=owner)
    try:
        h = reader.header()
        records, _ = reader.records(0)
    finally:
        reader.close()
    groups = {
        g.name: GroupSeq(g.started_seq, g.completed_seq, g.in_flight, g.started_ns, g.last_op, g.size) for g in h.groups
    }
    return RankData(
        rank=h.rank,
        pid=h.pid,
        world=h.world,
        records=records,
        group_names={g.index: g.name for g in h.groups},
        groups=groups,
        mono_anchor_ns=h.mono_anchor_ns,
        wall_anchor_ns=h.wall_anchor_ns,
        source="ring",
        alive=True,
        hostname=hostname,
        header=h,
        ring=Path(path),
    )


def from_log(meta: dict, records: list[Record]) -> RankData:
    names = {int(index): name for name, index in (meta.get("groups") or {}).items()}
    groups: dict[str, GroupSeq] = {}
    for r in records:
        if r.kind in (Kind.COLLECTIVE, Kind.P2P):
            name = names.get(r.group, str(r.group))
            g = groups.get(name)
            if g is None or r.seq > g.completed_seq:
                groups[name] = GroupSeq(r.seq, r.seq, False, r.start_ns, r.op)
    pid = meta.get("pid")
    local = meta.get("hostname") in (None, socket.gethostname())
    return RankData(
        rank=int(meta.get("rank", 0)),
        pid=pid,
        world=int(meta.get("world", 1)),
        records=records,
        group_names=names,
        groups=groups,
        mono_anchor_ns=int(meta.get("mono_anchor_ns", 0)),
        wall_anchor_ns=int(meta.get("wall_anchor_ns", 0)),
        source="log",
        alive=local and pid is not None and pid_alive(int(pid)),
        hostname=meta.get("hostname"),
    )


def load_dir(out_dir: Path, notes: list[str] | None = None) -> list[RankData]:
    """Every rank of a trace directory: the live ring where its process still runs on this host, else its log.
    A meta file the tracer did not write is skipped, with a line in ``notes`` (``logs.usable_runs``)."""
    from lingctl.timer import logs

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise NotFoundError(f"{out_dir}: no such directory")
    runs, skipped = logs.usable_runs(out_dir)
    if notes is not None:
        notes.extend(f"skipped {line}" for line in skipped)
    host = socket.gethostname()
    out = []
    for meta in runs:
        data = _from_left_ring(meta, host) if meta.get("hostname", host) == host else None
        out.append(data if data is not None else from_log(meta, read_records(meta)))
    return out


def _from_left_ring(meta: dict, host: str) -> RankData | None:
    """The ring of the process a meta file describes, if it is still there: the process runs, or was killed
    before it could remove it. Looked up by pid in the ring directory (never at a path the meta file names)
    and taken only if its clock anchors are the meta file's: a later process with the same pid is not it."""
    pid = meta.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        owner = os.stat(meta["meta_path"]).st_uid  # the traced process's user: its ring is in that user's dir
        ring = find_ring(pid, uid=owner)
        if ring is None:
            return None
        data = from_ring(ring, hostname=host, owner=os.lstat(ring).st_uid)
    except (OSError, ValueError, KeyError):
        return None  # gone since: its log has the rest
    h = data.header
    assert h is not None
    if (h.mono_anchor_ns, h.wall_anchor_ns) != (meta.get("mono_anchor_ns"), meta.get("wall_anchor_ns")):
        return None
    data.alive = pid_alive(pid, h.create_time)
    if not data.alive:
        data.stopped_ns = h.heartbeat_ns
    return data


def read_records(meta: dict) -> list[Record]:
    """The records of one run's log (none when the process never flushed one)."""
    from lingctl.timer import logs

    path = Path(meta.get("log_path") or "")
    return logs.read_log(path) if path.name and path.is_file() else []


def load_pids(pids: list[int]) -> list[RankData]:
    import psutil

    from lingctl.timer.attach import open_process

    out = []
    for pid in pids:
        proc = open_process(pid)
        ring = find_ring(pid, proc.create_time(), proc.uids().real)
        if ring is None:
            raise NotFoundError(
                f"process {pid} is not traced (no trace ring)",
                hint="start it under `lingctl timer run` or call lingctl.timer.install()",
            )
        try:
            out.append(from_ring(ring, hostname=socket.gethostname()))
        except (OSError, ValueError, psutil.Error) as err:
            raise NotFoundError(f"process {pid}: cannot read its trace ring ({err})") from None
    return out
