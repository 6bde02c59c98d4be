"""Where a step's time goes: pure functions over a process's finished-call records.

A step is one ``STEP`` record (its ``seq`` is the step number). Every nanosecond of a step is attributed to
exactly one category, so the parts of a step add up to its duration:

* the calls traced inside the step (data loading, forward, backward, optimizer, each collective by op name,
  point-to-point, copies) claim the time they cover, clipped to the step;
* where calls overlap (an ``all_reduce`` issued from a backward hook runs inside ``backward``), the time goes
  to the **innermost** call: the one that started last; on equal starts, the one that ends first. Backward
  time is therefore backward *compute* with the collectives inside it taken out, and nothing is counted twice;
* what no traced call covers is ``other`` (Python between calls, untraced work, the host waiting).

``GPU`` records time the device, which runs concurrently with the host, so they are kept out of the
partition and summed on their own (``gpu``).
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lingctl.timer.ring import Kind, Op, Record

# Categories in display order; collective op names go between "optimizer" and "p2p".
_LEADING = ("data", "forward", "backward", "optimizer")
_TRAILING = ("p2p", "copy", "other")
# Keyed by the raw kind as records carry it (Kind is an IntEnum, so its members hash as these ints).
_BY_KIND: dict[int, str] = {
    Kind.DATA: "data",
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.OPTIMIZER: "optimizer",
    Kind.P2P: "p2p",
    Kind.COPY: "copy",
}
COMPUTE = ("forward", "backward")


def op_name(op: int) -> str:
    """``all_reduce`` for ``Op.ALL_REDUCE``; ``op<N>`` for a code this version does not know."""
    try:
        return "collective" if op == Op.NONE else Op(op).name.lower()
    except ValueError:
        return f"op{op}"


def kind_name(kind: int) -> str:
    try:
        return Kind(kind).name.lower()
    except ValueError:
        return f"kind{kind}"


def category(record: Record) -> str | None:
    """The breakdown category a record's time counts under (None: not part of the host partition)."""
    if record.kind == Kind.COLLECTIVE:
        return op_name(record.op)
    return _BY_KIND.get(record.kind)


@dataclass(slots=True)
class StepTime:
    """One finished step; ``parts_ns`` add up to ``duration_ns`` exactly."""

    step: int
    start_ns: int
    end_ns: int
    parts_ns: dict[str, int]
    gpu_ns: int = 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class Summary:
    """Seconds over the window's steps."""

    mean: float
    median: float
    last: float

    @classmethod
    def of(cls, values_ns: Sequence[int]) -> Summary:
        if not values_ns:
            return cls(0.0, 0.0, 0.0)
        return cls(statistics.fmean(values_ns) / 1e9, statistics.median(values_ns) / 1e9, values_ns[-1] / 1e9)


@dataclass(slots=True)
class StepStats:
    steps: int  # finished steps in the window
    last_step: int | None
    step_time: Summary
    parts: dict[str, Summary]  # category -> seconds per step; means add up to step_time.mean
    throughput: float  # steps per second over the window (0 with no finished step)
    collective_seq: dict[int, int]  # group index -> highest collective sequence number seen
    gpu: Summary | None = None
    per_step: list[StepTime] = field(default_factory=list)

    def share(self, name: str) -> float:
        """Fraction of the mean step spent in category ``name``."""
        part = self.parts.get(name)
        return part.mean / self.step_time.mean if part is not None and self.step_time.mean > 0 else 0.0

    def to_json(self, group_names: dict[int, str] | None = None) -> dict:
        """The summary without the per-step list; collective groups by name when ``group_names`` knows them."""
        names = group_names or {}
        return {
            "steps": self.steps,
            "last_step": self.last_step,
            "step_time_s": _summary_json(self.step_time),
            "parts_s": {n: _summary_json(s) for n, s in self.parts.items()},
            "throughput_steps_per_s": self.throughput,
            "collective_seq": {names.get(g, str(g)): seq for g, seq in sorted(self.collective_seq.items())},
            "gpu_s": _summary_json(self.gpu) if self.gpu is not None else None,
        }


def _summary_json(s: Summary) -> dict[str, float]:
    return {"mean": s.mean, "median": s.median, "last": s.last}


def step_times(records: Iterable[Record], last_n_steps: int | None = None) -> list[StepTime]:
    """Each finished step (of the last ``last_n_steps``) with its time split by innermost category."""
    steps = sorted((r for r in records if r.kind == Kind.STEP), key=lambda r: r.start_ns)
    if last_n_steps is not None:
        steps = steps[-last_n_steps:] if last_n_steps > 0 else []
    if not steps:
        return []
    lo, hi = steps[0].start_ns, steps[-1].end_ns
    calls: list[tuple[int, int, str]] = []
    gpu: list[tuple[int, int]] = []
    for r in records:
        if r.end_ns <= lo or r.start_ns >= hi or r.end_ns <= r.start_ns:
            continue
        if r.kind == Kind.GPU:
            gpu.append((r.start_ns, r.end_ns))
            continue
        name = category(r)
        if name is not None:
            calls.append((r.start_ns, r.end_ns, name))
    out = [StepTime(s.seq, s.start_ns, s.end_ns, {}) for s in steps]
    _attribute(out, calls)
    starts = [s.start_ns for s in out]
    for start, end in gpu:
        i = bisect.bisect_right(starts, start) - 1
        if 0 <= i and start < out[i].end_ns:
            out[i].gpu_ns += min(end, out[i].end_ns) - start
    return out


def _attribute(steps: list[StepTime], calls: list[tuple[int, int, str]]) -> None:
    """Sweep the window once: between consecutive boundaries, the innermost open call (latest start, then
    earliest end) owns the time; with no open call it is ``other``. Steps do not overlap (one per process)."""
    points = sorted({p for s in steps for p in (s.start_ns, s.end_ns)} | {p for c in calls for p in c[:2]})
    calls.sort(key=lambda c: c[0])
    open_calls: list[tuple[int, int, int, str]] = []  # (-start, end, tie, name): heap top is the innermost
    nxt = 0
    si = 0
    for a, b in zip(points, points[1:]):
        while si < len(steps) and steps[si].end_ns <= a:
            si += 1
        if si == len(steps):
            break
        while nxt < len(calls) and calls[nxt][0] <= a:
            start, end, name = calls[nxt]
            heapq.heappush(open_calls, (-start, end, nxt, name))
            nxt += 1
        while open_calls and open_calls[0][1] <= a:  # closed calls leave lazily, when they reach the top
            heapq.heappop(open_calls)
        step = steps[si]
        if a < step.start_ns:
            continue  # between two steps
        name = open_calls[0][3] if open_calls else "other"
        step.parts_ns[name] = step.parts_ns.get(name, 0) + (b - a)


def breakdown(records: Iterable[Record], last_n_steps: int = 20) -> StepStats:
    """Step time and its parts (mean / median / last, in seconds) over the last ``last_n_steps`` finished steps,
    throughput, and the last collective sequence number seen per process group."""
    records = list(records)
    window = step_times(records, last_n_steps)
    seqs: dict[int, int] = {}
    for r in records:
        if r.kind == Kind.COLLECTIVE and r.seq > seqs.get(r.group, -1):
            seqs[r.group] = r.seq
    if not window:
        return StepStats(0, None, Summary.of([]), {}, 0.0, seqs)
    names = {n for s in window for n in s.parts_ns}
    collectives = sorted(names - set(_LEADING) - set(_TRAILING))
    order = [n for n in _LEADING if n in names] + collectives + [n for n in _TRAILING if n in names or n == "other"]
    parts = {n: Summary.of([s.parts_ns.get(n, 0) for s in window]) for n in order}
    span = window[-1].end_ns - window[0].start_ns
    gpu = Summary.of([s.gpu_ns for s in window]) if any(s.gpu_ns for s in window) else None
    return StepStats(
        steps=len(window),
        last_step=window[-1].step,
        step_time=Summary.of([s.duration_ns for s in window]),
        parts=parts,
        throughput=len(window) / (span / 1e9) if span > 0 else 0.0,
        collective_seq=seqs,
        gpu=gpu,
        per_step=window,
    )
