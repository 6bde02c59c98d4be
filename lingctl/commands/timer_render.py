"""Human text for `lingctl timer attach` and `lingctl timer diagnose`; the library gives snapshots and
``Diagnosis`` objects (and their JSON), this module turns them into lines for people."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lingctl.core.units import format_size
from lingctl.timer.attach import STALE_HEARTBEAT_S, describe_inside
from lingctl.timer.diagnose import Diagnosis, format_ranks

if TYPE_CHECKING:
    from rich.console import Console


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def status_line(snap: dict) -> str:
    """One line per refresh (off a terminal): step, step time and its largest parts, where the process is now."""
    p = snap["process"]
    proc = f"cpu {p['cpu_percent']:.0f}%, rss {format_size(p['rss_bytes'])}, {p['status']}"
    t = snap["trace"]
    if t is None:
        return f"pid {snap['pid']}: {proc}; {snap['note']}"
    b = t["breakdown"]
    parts = sorted(b["parts_s"].items(), key=lambda kv: -kv[1]["mean"])[:4]
    mean = b["step_time_s"]["mean"]
    split = ", ".join(f"{name} {s['mean'] / mean:.0%}" for name, s in parts) if mean > 0 else "no finished step"
    return (
        f"rank {t['rank']}/{t['world']} step {t['step']}: {_ms(mean)}/step ({split}); "
        f"{describe_inside(t['inside'])}; heartbeat {t['heartbeat_age_s']:.1f} s ago; {proc}"
    )


def render(snap: dict) -> str:
    """The full snapshot for people: process, GPU, trace state, step breakdown, groups, stacks."""
    p = snap["process"]
    lines = [
        f"pid {snap['pid']}  {' '.join(p['cmdline'])[:120]}",
        f"  {p['status']}, cpu {p['cpu_percent']:.0f}%, rss {format_size(p['rss_bytes'])}, {p['threads']} threads, "
        f"user {p['user']}",
    ]
    for g in snap["gpus"] or []:
        lines.append(
            f"  gpu {g['index']} {g['name']}: {g['utilization_percent']}% busy, process holds "
            f"{format_size(g['process_memory_bytes'])} ({format_size(g['memory_used_bytes'])} of "
            f"{format_size(g['memory_total_bytes'])} used)"
        )
    if snap["gpu_note"] and snap["gpus"] is None:
        lines.append(f"  {snap['gpu_note']}")
    t = snap["trace"]
    lines += [snap["note"]] if t is None else _trace_lines(t)
    if snap["stacks"]:
        lines.append(f"stacks ({snap['stacks_source']}):")
        lines.extend("  " + line for line in snap["stacks"].rstrip().splitlines())
    if snap["stacks_note"]:
        lines.append(f"stacks: {snap['stacks_note']}")
    return "\n".join(lines)


def _trace_lines(t: dict) -> list[str]:
    """What the ring shows: rank, step and where the process is, the step breakdown, each group's progress."""
    beat = t["heartbeat_age_s"]
    lines = [
        f"rank {t['rank']} of {t['world']} (local {t['local_rank']}), step {t['step']}, "
        f"{describe_inside(t['inside'])}; heartbeat {beat:.1f} s ago"
    ]
    if beat > STALE_HEARTBEAT_S:
        lines.append(
            "  the heartbeat is stale: the process holds the GIL in native code, is stopped, or "
            "tracing stopped (try --stacks)"
        )
    if not t["enabled"]:
        lines.append("  tracing disabled itself after an internal error: the figures below stop there")
    b = t["breakdown"]
    if b["steps"]:
        st = b["step_time_s"]
        lines.append(
            f"last {b['steps']} steps: {_ms(st['mean'])} mean, {_ms(st['median'])} median, "
            f"{_ms(st['last'])} last; {b['throughput_steps_per_s']:.2f} steps/s"
        )
        for name, s in b["parts_s"].items():
            share = s["mean"] / st["mean"] if st["mean"] > 0 else 0.0
            lines.append(f"  {name:<15} {_ms(s['mean']):>10} mean {_ms(s['last']):>10} last  {share:5.1%}")
    else:
        lines.append("no finished step yet (steps end at the optimizer's step())")
    for g in t["groups"]:
        state = "in flight" if g["in_flight"] else "idle"
        lines.append(
            f"  group {g['name']} (size {g['size']}): started #{g['started_seq']}, completed "
            f"#{g['completed_seq']}, {state}, last {g['last_op']}"
        )
    return lines


def render_diagnosis(d: Diagnosis) -> str:
    """The verdict, the stuck groups, where each rank is, the straggler's evidence, stacks and notes."""
    lines = [f"verdict: {d.verdict}: {d.summary}"]
    for g in d.groups:
        if g.waiting or g.never_arrived:
            lines.append(
                f"group {g.group}: {g.op} #{g.seq}: waiting {format_ranks(g.waiting) or 'none'}, never "
                f"arrived {format_ranks(g.never_arrived) or 'none'}"
            )
    for r in d.ranks:
        beat = f", heartbeat {r.heartbeat_age_s:.1f} s ago" if r.heartbeat_age_s is not None else ""
        step = f"step {r.step}" if r.step is not None else "no step"
        lines.append(f"rank {r.rank} (pid {r.pid}, {r.source}): {step}, {r.where}{beat}")
    if d.straggler is not None:
        s = d.straggler
        lines.append(
            f"straggler: rank {s.rank} ({s.category}), last to arrive at "
            f"{s.last_arrival_share:.0%} of {d.collectives_compared} collectives"
        )
        for metric, values in s.evidence.items():
            lines.append(f"  {metric:<12} " + "  ".join(f"r{k}={v * 1e3:.1f}ms" for k, v in sorted(values.items())))
    for r in d.ranks:
        if r.stacks:
            lines.append(f"stacks of rank {r.rank} (pid {r.pid}):")
            lines.extend("  " + line for line in r.stacks.rstrip().splitlines())
        elif r.stacks_note:
            lines.append(f"stacks of rank {r.rank} (pid {r.pid}): {r.stacks_note}")
    lines.extend(f"note: {n}" for n in d.notes)
    return "\n".join(lines)


def print_diagnosis(d: Diagnosis, console: Console) -> None:
    """The verdict, then each rank's step breakdown (the ``breakdown`` of the JSON): mean seconds per step
    and the share of each part, so the numbers behind a straggler verdict are on screen."""
    console.print(render_diagnosis(d), markup=False)
    rows = [(r.rank, r.breakdown) for r in d.ranks if r.breakdown.get("steps")]
    if not rows:
        return
    from rich.table import Table

    parts = list(dict.fromkeys(name for _, b in rows for name in b["parts_s"]))
    table = Table(
        title="step breakdown (mean ms per step, share of the step)", title_justify="left", box=None, pad_edge=False
    )
    for column in ("rank", "steps", "step", *parts):
        table.add_column(column, justify="left" if column == "rank" else "right")
    for rank, b in rows:
        step_s = b["step_time_s"]["mean"] or 0.0
        cells = []
        for name in parts:
            mean = (b["parts_s"].get(name) or {}).get("mean") or 0.0
            cells.append(f"{mean * 1e3:.1f} ({mean / step_s:.0%})" if step_s > 0 else f"{mean * 1e3:.1f}")
        table.add_row(str(rank), str(b["steps"]), f"{step_s * 1e3:.1f}", *cells)
    console.print(table)
