"""Whole-job diagnosis from every rank's trace: is the job hung (and on whom), or is one rank slowing the rest?

**Hangs** are read off the per-group collective sequence numbers each rank keeps in its ring header, with no
search (XPUTimer's O(1) localisation, Ling report §4): in a process group every member enters collective
``#n`` in the same order, so for each group the highest sequence number any member has *started* is the
collective the job is stuck in. Members that started it and are still inside are *waiting*; members whose
started number is lower *never arrived*, and what they are inside now (their ring's current call, step and
heartbeat, their Python stacks) says where they are stuck. The job is hung when some rank has waited longer
than ``hang_after_s``.

**Slowdowns** compare the ranks over the last collectives they all finished, matched by (group, seq): the rank
whose start comes last on the common wall clock in a clear majority of them holds the others back. Its step
breakdown against the other ranks' says why: data loading (``data``), forward/backward compute (``compute``),
or untraced host work (``other``), whichever exceeds the other ranks' median by the most. Without such a
majority, a rank whose data, compute or other time is an outlier is the straggler; when arrivals are even but
one rank's collectives take much longer, the slowness is in ``communication``. A value is an outlier when it
exceeds ``OUTLIER_RATIO`` times the median of the other ranks, and by a significant margin: at least
``MIN_GAP_S`` and ``MIN_GAP_SHARE`` of the median step time (the same margin a majority of late arrivals must
amount to).

Each rank is read by ``rank_data.py``: from its live ring, the ring a killed process left, or its log.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.timer.attach import ask_for_stacks, describe_inside, header_facts
from lingctl.timer.rank_data import GroupSeq, RankData, load_dir, load_pids
from lingctl.timer.ring import Kind, Op, Record
from lingctl.timer.steps import COMPUTE, breakdown, kind_name, op_name

OUTLIER_RATIO = 1.5
MIN_GAP_S = 0.001  # below this a difference is noise, whatever the ratio ...
MIN_GAP_SHARE = 0.05  # ... and below this share of the median step time
MAJORITY = 0.6  # share of collectives a rank must arrive last at to be called the straggler
MIN_COLLECTIVES = 3
TIE_NS = 10_000  # arrivals closer than this are a tie: nobody was last
P2P_OPS = (Op.SEND, Op.RECV)


@dataclass(slots=True)
class RankReport:
    rank: int
    pid: int | None
    hostname: str | None
    source: str
    alive: bool
    step: int | None
    heartbeat_age_s: float | None
    inside: dict | None
    where: str
    started_seq: dict[str, int]
    breakdown: dict
    stacks: str | None = None
    stacks_note: str | None = None  # why a rank that was asked for its stacks has none


@dataclass(slots=True)
class GroupReport:
    """The newest collective of one group and who is where relative to it."""

    group: str
    size: int
    seq: int  # highest sequence number started by any member
    op: str
    waiting: dict[int, float]  # rank -> seconds inside this collective
    never_arrived: list[int]
    finished: list[int]  # left it already (or, from logs, completed it)
    mismatched_ops: dict[int, str] = field(default_factory=dict)  # rank -> op, where it differs at this seq


@dataclass(slots=True)
class Straggler:
    rank: int
    category: str  # data | compute | communication | other | unknown
    last_arrival_share: float
    evidence: dict[str, dict[int, float]]  # metric -> rank -> seconds (mean per step / per collective)


@dataclass(slots=True)
class Diagnosis:
    verdict: str  # hang | straggler | ok
    summary: str
    hang_after_s: float
    ranks: list[RankReport]
    groups: list[GroupReport]
    straggler: Straggler | None
    collectives_compared: int
    last_arrivals: dict[int, int]  # rank -> collectives it arrived last at
    mean_lateness_s: dict[int, float]  # rank -> mean start behind the median of the other ranks
    notes: list[str]

    def to_json(self) -> dict:
        from lingctl.core.output import to_jsonable

        return to_jsonable(self)


def format_ranks(items: Any) -> str:
    """``{3, 1}`` -> ``1, 3``: rank numbers as the summary and notes list them."""
    return ", ".join(str(r) for r in sorted(items))


# -- entry -------------------------------------------------------------------------------------------------
def diagnose(
    out_dir: Path | None = None,
    pids: list[int] | None = None,
    *,
    hang_after_s: float = 5.0,
    stacks: bool = True,
    last_collectives: int = 50,
    last_steps: int = 20,
) -> Diagnosis:
    """Diagnose a job from its trace directory (``lingctl timer run --out DIR`` / ``install(out)``) or from the
    pids of its traced processes. Raises ``NotFoundError`` when there is nothing to read."""
    if (out_dir is None) == (pids is None):
        raise ValueError("give exactly one of out_dir and pids")
    notes: list[str] = []
    ranks = load_dir(out_dir, notes) if out_dir is not None else load_pids(pids or [])
    return analyse(
        ranks,
        hang_after_s=hang_after_s,
        stacks=stacks,
        last_collectives=last_collectives,
        last_steps=last_steps,
        notes=notes,
    )


# -- analysis ----------------------------------------------------------------------------------------------
def analyse(
    ranks: list[RankData],
    *,
    hang_after_s: float = 5.0,
    stacks: bool = True,
    last_collectives: int = 50,
    last_steps: int = 20,
    now_ns: int | None = None,
    notes: list[str] | None = None,
) -> Diagnosis:
    """The diagnosis of ``ranks`` (see the module doc). ``now_ns``: the monotonic clock of the live ranks;
    ``notes``: what loading them found, to go first among the diagnosis's notes."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    notes = list(notes or [])
    ranks = _one_per_rank(ranks, notes)
    world = max([r.world for r in ranks] + [len(ranks)])
    _note_missing(ranks, world, notes)
    groups = _group_reports(ranks, now, world)
    waits = [(w, g) for g in groups for w in g.waiting.values()]
    longest: tuple[float, GroupReport | None] = max(waits, default=(0.0, None), key=lambda x: x[0])
    stats = {r.rank: breakdown(r.records, last_steps) for r in ranks}
    reports = [_rank_report(r, stats[r.rank], now) for r in ranks]
    hung = longest[0] >= hang_after_s
    if hung and stacks:
        behind = sorted({k for g in groups for k in g.never_arrived if g.waiting})
        _attach_stacks([r for r in ranks if r.rank in behind], reports)
    slow = _slowdown(ranks, stats, last_collectives)
    if hung:
        assert longest[1] is not None
        verdict, summary = "hang", _hang_summary(longest[1], longest[0], reports)
    elif slow.straggler is not None:
        verdict, summary = "straggler", _straggler_summary(slow.straggler, slow.compared)
    else:
        verdict, summary = "ok", _ok_summary(longest, hang_after_s)
        if slow.compared < MIN_COLLECTIVES:
            notes.append(f"only {slow.compared} collective(s) common to all ranks: too few to compare arrivals")
    _note_ended(ranks, groups, notes)
    return Diagnosis(
        verdict=verdict,
        summary=summary,
        hang_after_s=hang_after_s,
        ranks=reports,
        groups=groups,
        straggler=slow.straggler,
        collectives_compared=slow.compared,
        last_arrivals=slow.last,
        mean_lateness_s=slow.lateness,
        notes=notes,
    )


def _note_missing(ranks: list[RankData], world: int, notes: list[str]) -> None:
    missing = sorted(set(range(world)) - {r.rank for r in ranks})
    if missing:
        listed = format_ranks(missing[:16]) + (f", ... ({len(missing)} in all)" if len(missing) > 16 else "")
        notes.append(f"no trace for rank(s) {listed} of {world}: they are not in the analysis")


def _note_ended(ranks: list[RankData], groups: list[GroupReport], notes: list[str]) -> None:
    """Ranks read from logs that stopped before a collective others reached: a hang the job ended in."""
    for g in groups:
        ended = [r.rank for r in ranks if r.rank in g.never_arrived and r.source == "log"]
        if ended and not g.waiting:
            notes.append(
                f"rank(s) {format_ranks(ended)} stopped before {g.op} #{g.seq} of group {g.group}, which other "
                "ranks completed or started (logs hold finished calls only: a hang the job ended in "
                "shows as this)"
            )


def _hang_summary(g: GroupReport, waited_s: float, reports: list[RankReport]) -> str:
    summary = (
        f"rank(s) {format_ranks(g.waiting)} waiting in {g.op} #{g.seq} of group {g.group} for up to {waited_s:.1f} s; "
    )
    if g.never_arrived:
        where = "; ".join(f"rank {r.rank} {r.where}" for r in reports if r.rank in g.never_arrived)
        summary += f"never arrived: {where}"
    else:
        summary += "every member is inside it: the collective itself is stuck (network, or mismatched calls)"
    if g.mismatched_ops:
        summary += "; members are in different collectives at this sequence number: " + ", ".join(
            f"rank {k} {v}" for k, v in sorted(g.mismatched_ops.items())
        )
    return summary


def _straggler_summary(straggler: Straggler, compared: int) -> str:
    summary = f"rank {straggler.rank} is the straggler ({straggler.category})"
    if straggler.last_arrival_share:
        summary += f": last to arrive at {straggler.last_arrival_share:.0%} of the last {compared} collectives"
    return summary


def _ok_summary(longest: tuple[float, GroupReport | None], hang_after_s: float) -> str:
    summary = "no hang and no straggler"
    if longest[1] is not None and longest[0] > 0:
        summary += f" (longest wait in a collective {longest[0]:.1f} s, threshold {hang_after_s:g} s)"
    return summary


def _one_per_rank(ranks: list[RankData], notes: list[str]) -> list[RankData]:
    """One process per rank. A directory may also hold a launcher (traced, but never in a process group: it
    reports rank 0 of 1) or an earlier run; the process that took part in the job wins."""
    best: dict[int, RankData] = {}
    for r in ranks:
        key = (r.world > 1, bool(r.groups), r.alive, len(r.records))
        other = best.get(r.rank)
        if other is None or key > (other.world > 1, bool(other.groups), other.alive, len(other.records)):
            best[r.rank] = r
    skipped = [r for r in ranks if best[r.rank] is not r]
    if skipped:
        notes.append(
            "ignored "
            + ", ".join(f"pid {r.pid} (also rank {r.rank})" for r in skipped)
            + ": a launcher or another run in the same directory"
        )
    return sorted(best.values(), key=lambda r: r.rank)


def _group_reports(ranks: list[RankData], now: int, world: int) -> list[GroupReport]:
    names = sorted({name for r in ranks for name in r.groups}, key=lambda n: (not n.isdigit(), n.zfill(12)))
    out = []
    for name in names:
        states = {r.rank: r.groups[name] for r in ranks if name in r.groups}
        size = max(s.size for s in states.values())
        if size >= world:
            # Every rank belongs to a group as large as the job, including those that never reached its first
            # collective (they have not registered it yet).
            for r in ranks:
                states.setdefault(r.rank, GroupSeq(-1, -1, False, 0, 0, size))
        if all(s.last_op in P2P_OPS for s in states.values() if s.started_seq >= 0):
            # Sends and receives pair two ranks, so numbers are not comparable across a group; only waits are.
            seq, op = -1, "p2p"
        else:
            seq = max(s.started_seq for s in states.values())
            ops = Counter(s.last_op for s in states.values() if s.started_seq == seq)
            op = op_name(ops.most_common(1)[0][0]) if ops else "?"
        by_rank = {r.rank: r for r in ranks}
        waiting, behind, finished, mismatched = {}, [], [], {}
        for k, s in sorted(states.items()):
            inside = s.in_flight and s.completed_seq < s.started_seq
            if inside and (seq < 0 or s.started_seq == seq):
                r = by_rank[k]
                waiting[k] = max(0, _now_of(r, now) - s.started_ns) / 1e9 if r.source == "ring" else 0.0
            elif s.started_seq < seq:
                behind.append(k)
            else:
                finished.append(k)
            if seq >= 0 and s.started_seq == seq and op_name(s.last_op) != op:
                mismatched[k] = op_name(s.last_op)
        out.append(GroupReport(name, size, seq, op, waiting, behind, finished, mismatched))
    return out


def _now_of(r: RankData, now: int) -> int:
    """The moment a rank's ring state is read at: now for a live process, its last heartbeat for a dead one."""
    return r.stopped_ns if r.stopped_ns is not None else now


def _rank_report(r: RankData, stats: Any, now: int) -> RankReport:
    started = {name: g.started_seq for name, g in r.groups.items()}
    if r.header is not None:
        facts = header_facts(r.header, _now_of(r, now))
        where = describe_inside(facts["inside"])
        if r.stopped_ns is not None:  # durations run up to its last heartbeat
            where = f"exited; its ring shows it was {where} when it stopped"
        if not facts["enabled"]:
            where += " (tracing disabled itself)"
        age = None if r.stopped_ns is not None else facts["heartbeat_age_s"]
        return RankReport(
            r.rank,
            r.pid,
            r.hostname,
            r.source,
            r.alive,
            r.header.step,
            age,
            facts["inside"],
            where,
            started,
            stats.to_json(r.group_names),
        )
    if r.hostname not in (None, socket.gethostname()):
        where = f"on {r.hostname}: read from its log, no live state"
    else:
        where = "running, but its ring was not readable" if r.alive else "exited"
    calls = [x for x in r.records if x.kind != Kind.STEP]
    if calls:
        last = max(calls, key=lambda x: x.end_ns)
        name = op_name(last.op) if last.kind in (Kind.COLLECTIVE, Kind.P2P) else kind_name(last.kind)
        where += f"; its last finished traced call was {name}"
    finished = stats.last_step + 1 if stats.last_step is not None else None
    return RankReport(
        r.rank, r.pid, r.hostname, r.source, r.alive, finished, None, None, where, started, stats.to_json(r.group_names)
    )


def _attach_stacks(ranks: list[RankData], reports: list[RankReport]) -> None:
    todo = [r for r in ranks if r.alive and r.ring is not None and r.pid is not None]
    if not todo:
        return
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        found = dict(zip((r.rank for r in todo), pool.map(lambda r: ask_for_stacks(r.pid, r.ring), todo)))
    for rep in reports:
        if rep.rank in found:
            rep.stacks, rep.stacks_note = found[rep.rank]


@dataclass(slots=True)
class _Slowdown:
    """What comparing the ranks' arrivals at their last common collectives found."""

    compared: int  # collectives compared
    last: dict[int, int]  # rank -> collectives it arrived last at
    lateness: dict[int, float]  # rank -> mean start behind the median of the other ranks, seconds
    straggler: Straggler | None


def _slowdown(ranks: list[RankData], stats: dict[int, Any], last_n: int) -> _Slowdown:
    if len(ranks) < 2:
        return _Slowdown(0, {}, {}, None)
    calls: dict[int, dict[tuple[str, int], Record]] = {}
    for r in ranks:
        calls[r.rank] = {
            (r.group_names.get(c.group, str(c.group)), c.seq): c for c in r.records if c.kind == Kind.COLLECTIVE
        }
    wall = {r.rank: r.to_wall_ns for r in ranks}
    common = set.intersection(*(set(c) for c in calls.values()))
    keys = sorted(common, key=lambda k: statistics.median(wall[r](calls[r][k].start_ns) for r in calls))[-last_n:]
    last: Counter[int] = Counter()
    late: dict[int, list[float]] = {r: [] for r in calls}
    for key in keys:
        starts = {r: wall[r](calls[r][key].start_ns) for r in calls}
        order = sorted(starts, key=lambda r: starts[r])
        if starts[order[-1]] - starts[order[-2]] >= TIE_NS:
            last[order[-1]] += 1
        for rank, s in starts.items():
            late[rank].append((s - statistics.median(v for q, v in starts.items() if q != rank)) / 1e9)
    lateness = {r: statistics.fmean(v) if v else 0.0 for r, v in late.items()}
    step_means = [s.step_time.mean for s in stats.values() if s.steps]
    gap = max(MIN_GAP_S, MIN_GAP_SHARE * statistics.median(step_means)) if step_means else MIN_GAP_S
    evidence = _evidence(stats, calls, keys)
    straggler = _straggler(len(keys), last, lateness, evidence, gap)
    return _Slowdown(len(keys), dict(last), lateness, straggler)


def _evidence(
    stats: dict[int, Any], calls: dict[int, dict[tuple[str, int], Record]], keys: list[tuple[str, int]]
) -> dict[str, dict[int, float]]:
    """Per metric, each rank's mean seconds: per step for data, compute, other and the step; per compared
    collective for collective time."""
    return {
        "data": {r: s.parts["data"].mean if "data" in s.parts else 0.0 for r, s in stats.items()},
        "compute": {r: sum(s.parts[c].mean for c in COMPUTE if c in s.parts) for r, s in stats.items()},
        "other": {r: s.parts["other"].mean if "other" in s.parts else 0.0 for r, s in stats.items()},
        "collective": {
            r: statistics.fmean(calls[r][k].duration_ns for k in keys) / 1e9 if keys else 0.0 for r in calls
        },
        "step": {r: s.step_time.mean for r, s in stats.items()},
    }


def _straggler(
    n: int, last: Counter[int], lateness: dict[int, float], evidence: dict[str, dict[int, float]], gap: float
) -> Straggler | None:
    """The rank that arrives last at a clear majority of the ``n`` collectives; without one, the one rank
    whose data, compute, other or collective time is an outlier."""
    leader, count = last.most_common(1)[0] if last else (None, 0)
    if n >= MIN_COLLECTIVES and leader is not None and count / n >= MAJORITY and lateness[leader] >= gap:
        return Straggler(leader, _category(leader, evidence, gap), count / n, evidence)
    for metric, category in (
        ("data", "data"),
        ("compute", "compute"),
        ("other", "other"),
        ("collective", "communication"),
    ):
        if metric == "collective" and n < MIN_COLLECTIVES:
            continue
        outliers = [r for r in evidence[metric] if _outlier(evidence[metric], r, gap)]
        if len(outliers) == 1:
            return Straggler(outliers[0], category, last.get(outliers[0], 0) / n if n else 0.0, evidence)
    return None


def _category(rank: int, evidence: dict[str, dict[int, float]], gap: float) -> str:
    """Why the rank that arrives last is late: the part of its step that exceeds the other ranks' most."""
    excess = {
        m: evidence[m][rank] - statistics.median(v for r, v in evidence[m].items() if r != rank)
        for m in ("data", "compute", "other")
    }
    best = max(excess, key=lambda m: excess[m])
    return best if excess[best] >= gap else "unknown"


def _outlier(values: dict[int, float], rank: int, gap: float) -> bool:
    others = [v for r, v in values.items() if r != rank]
    if not others:
        return False
    base = statistics.median(others)
    return values[rank] > OUTLIER_RATIO * base and values[rank] - base >= gap
