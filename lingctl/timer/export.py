"""Every rank's trace on one timeline, as a Chrome trace / Perfetto JSON file (open in ui.perfetto.dev).

Each rank is one "process" (pid = rank) with three tracks: its steps, its host calls (data, forward, backward,
optimizer, collectives, copies) and its GPU records. Times are the ranks' monotonic clocks moved onto the
wall clock through each rank's anchors (read together at start-up), so collectives line up across ranks;
the earliest event is time 0. Chrome's format counts in microseconds.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import NotFoundError
from lingctl.timer.rank_data import read_records
from lingctl.timer.ring import Kind, Record
from lingctl.timer.steps import kind_name, op_name

_TRACKS = {"steps": 0, "host": 1, "gpu": 2}


def event_name(r: Record, group_names: dict[int, str]) -> str:
    """``forward``, ``step 12``, ``all_reduce #12 (group 0)``."""
    if r.kind == Kind.STEP:
        return f"step {r.seq}"
    if r.kind in (Kind.COLLECTIVE, Kind.P2P):
        return f"{op_name(r.op)} #{r.seq} (group {group_names.get(r.group, str(r.group))})"
    return kind_name(r.kind)


def rank_events(records: list[Record], *, rank: int, to_wall_ns: Any, group_names: dict[int, str]) -> list[dict]:
    """One rank's complete events, ``ts`` and ``dur`` in wall-clock nanoseconds (scaled by the caller)."""
    steps = sorted((r for r in records if r.kind == Kind.STEP), key=lambda r: r.start_ns)
    starts = [s.start_ns for s in steps]
    out = []
    for r in records:
        args: dict[str, Any]
        if r.kind == Kind.STEP:
            track, args = "steps", {"step": r.seq}
        else:
            track = "gpu" if r.kind == Kind.GPU else "host"
            args = {}
            if r.kind in (Kind.COLLECTIVE, Kind.P2P):
                args["seq"] = r.seq
                args["group"] = group_names.get(r.group, str(r.group))
            if r.value:
                args["bytes"] = r.value
            step = _step_at(steps, starts, r.start_ns)
            if step is not None:
                args["step"] = step
        out.append(
            {
                "name": event_name(r, group_names),
                "cat": kind_name(r.kind),
                "ph": "X",
                "pid": rank,
                "tid": _TRACKS[track],
                "ts": to_wall_ns(r.start_ns),
                "dur": max(0, r.duration_ns),
                "args": args,
            }
        )
    return out


def _step_at(steps: list[Record], starts: list[int], t: int) -> int | None:
    """The step a call at ``t`` belongs to: the one running, or between two steps the next one."""
    i = bisect.bisect_right(starts, t) - 1
    if i < 0:
        return steps[0].seq if steps else None
    return steps[i].seq if t < steps[i].end_ns else steps[i].seq + 1


def metadata(rank: int, pid: Any) -> list[dict]:
    meta = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (pid {pid})"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for name, tid in _TRACKS.items()
    ]
    return meta


def export_chrome(out_dir: Path, dest: Path) -> int:
    """Write ``dest`` from the logs in ``out_dir``; returns the number of complete events written."""
    from lingctl.timer import logs

    if not Path(out_dir).is_dir():
        raise NotFoundError(f"{out_dir}: no such directory")
    runs, _ = logs.usable_runs(Path(out_dir))  # the files it skips are logged as warnings
    events: list[dict] = []
    header: list[dict] = []
    for meta in runs:
        rank = int(meta.get("rank", 0))
        mono, wall = int(meta.get("mono_anchor_ns", 0)), int(meta.get("wall_anchor_ns", 0))
        names = {int(index): name for name, index in (meta.get("groups") or {}).items()}
        records = read_records(meta)
        events += rank_events(records, rank=rank, to_wall_ns=lambda t, m=mono, w=wall: t - m + w, group_names=names)
        header += metadata(rank, meta.get("pid"))
    t0 = min((e["ts"] for e in events), default=0)
    for e in events:
        e["ts"] = (e["ts"] - t0) / 1000
        e["dur"] = e["dur"] / 1000
    events.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    with atomic_write(Path(dest)) as (_, f):
        f.write(json.dumps({"traceEvents": header + events, "displayTimeUnit": "ms"}).encode())
    return len(events)
