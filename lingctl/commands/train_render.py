"""Human views of ``lingctl train``, drawn from its records and results alone: the live view of a run, its
summary, ``train status`` and the ``train align`` report.

The library returns records (metrics records, ``TrainResult``, ``RunStatus``, ``AlignReport``); writing them
for people is this module's job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lingctl.commands.status_view import StatusView
from lingctl.core.output import Output, to_jsonable
from lingctl.core.units import format_whole_duration
from lingctl.runs.records import Record

if TYPE_CHECKING:
    from rich.console import Console

    from lingctl.runs.status import RunStatus
    from lingctl.train.align.trace import AlignReport
    from lingctl.train.trainer import TrainResult

ALIGN_ROWS = 10  # train align: rows shown without --show


class TrainView:
    """A run's live view from its records: a Rich bar with loss, tokens/s and expert balance on a terminal;
    JSON lines with --json; a status line every few seconds otherwise (logs, CI), and for the first and the
    last step."""

    def __init__(self, out: Output, *, on_start: Callable[[], None] = lambda: None) -> None:
        self.out = out
        self._on_start = on_start  # the run has reached its first step
        self._view = StatusView(out)
        self._total = 0
        self._done = 0  # steps on the bar
        self._first: tuple[int, float] | None = None  # (step, time) of this process's first step record

    def __enter__(self) -> TrainView:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._view.__exit__(*exc)

    def record(self, record: Record) -> None:
        if record["event"] == "start":
            self._on_start()
        if self.out.json_mode:
            self.out.record(record)
            return
        event = record["event"]
        if event == "start":
            self._start(record)
        elif event == "step":
            self._step(record)
        elif event == "checkpoint" and not self.out.progress_enabled:
            self.out.info(f"step {record['step']} checkpoint {record['path']}")
        elif event in _MESSAGES:
            warn, text = _MESSAGES[event]
            (self.out.warn if warn else self.out.info)(text(record))

    def _start(self, r: Record) -> None:
        workers = f", {r['workers']} workers ({r['sync']})" if r.get("workers", 1) > 1 else ""
        self.out.info(
            f"run {r['run_dir']}: {r['preset']}, {r['parameters'] / 1e6:.1f}M parameters "
            f"({r['active_parameters'] / 1e6:.1f}M active), {r['train_sequences']} training sequences of "
            f"{r['seq_len']} tokens{workers}"
        )
        self._total, self._done = r["steps"], r["step"]
        self._view.update("training", "training", completed=self._done, total=self._total)

    def _step(self, r: Record) -> None:
        text = step_text(r)
        self._done += 1
        self._view.update("training", f"step {r['step']} {text}", completed=self._done, total=self._total)
        if self._first is None:
            self._first = (r["step"], r["time"])
        edge = self._first[0] == r["step"] or r["step"] >= self._total
        self._view.log(f"step {r['step']}/{self._total} {text}{self._eta(r)}", now=edge)

    def _eta(self, r: Record) -> str:
        """ " ETA 4m12s" from this process's average time per step so far (none before its second step)."""
        assert self._first is not None
        done = r["step"] - self._first[0]
        if done < 1:
            return ""
        per_step = (r["time"] - self._first[1]) / done
        return f" ETA {format_whole_duration(per_step * max(self._total - r['step'], 0))}"


def step_text(r: Record) -> str:
    """A step record in a few words: loss, learning rate, throughput (per worker too) and the worst layer's
    expert balance."""
    cv = max((x["cv"] for x in r["expert_load"]), default=0.0)
    paces = r.get("worker_tokens_per_s")
    per_worker = f" ({'/'.join(f'{x:,.0f}' for x in paces)} per worker)" if paces else ""
    task = r.get("task") or {}
    dpo = f" margin {task['reward_margin']:.3f} acc {task['reward_accuracy']:.2f}" if "reward_margin" in task else ""
    return f"loss {r['loss']:.3f}{dpo} lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s{per_worker} expert cv {cv:.2f}"


def _preparing(r: Record) -> str:
    where = f"; {r['report_to']} files in {r['report_dir']}" if "report_dir" in r else ""
    return f"preparing run {r['run_dir']}: tokenizing data, building the model{where}"


def _incident(r: Record) -> str:
    where = f", back to step {r['restored_step']}" if r.get("restored_step") is not None else ""
    return f"watchdog: {r['kind']}, {r['action']}{where}: {r['reason']}"


# The other records a view shows: event -> (a warning?, its line).
_MESSAGES: dict[str, tuple[bool, Callable[[Record], str]]] = {
    "preparing": (False, _preparing),
    "eval": (False, lambda r: f"step {r['step']} eval loss {r['eval_loss']:.3f}"),
    "spike": (True, lambda r: f"step {r['step']}: loss spike skipped ({r['reason']}), {r['action']}"),
    "incident": (True, _incident),
    "lr_drop": (True, lambda r: f"step {r['step']}: repeated spikes, learning rate scaled to {r['lr_scale']:g}"),
}


def result_json(result: TrainResult) -> dict[str, Any]:
    return {"event": "done", **to_jsonable(result)}


def render_result(r: TrainResult, console: Console) -> None:
    loss = f"loss {r.first_loss:.3f} -> {r.last_loss:.3f}" if r.first_loss is not None else "no new steps"
    evals = f", eval loss {r.eval_loss:.3f}" if r.eval_loss is not None else ""
    speed = f", {r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s is not None else ""
    wall = f", wall time {format_whole_duration(r.wall_s)}" if r.wall_s is not None else ""
    if r.resumed_from is not None:
        # The training time counts every session of the run; the speed and wall time are this session's.
        timing = f"{r.elapsed_s:.0f} s of training over all sessions; this session{wall.removeprefix(',')}{speed}"
    else:
        timing = f"{r.elapsed_s:.0f} s{speed}{wall}"
    console.print(
        f"{r.stopped}: {r.steps}/{r.target_steps} steps, {r.tokens:,} tokens, {loss}{evals}, "
        f"{r.spikes_skipped} spike(s) skipped, {timing}",
        markup=False,
    )
    if r.checkpoint:
        console.print(f"checkpoint: {r.run_dir}/{r.checkpoint}", markup=False)


def render_status(s: RunStatus, console: Console) -> None:
    target = f"/{s.target_steps}" if s.target_steps else ""
    age = f"{s.last_record_age_s:.0f} s ago" if s.last_record_age_s is not None else ""
    state = (
        "finished"
        if s.finished
        else f"stopped ({s.stopped}) {age}, checkpoint saved: lingctl train --resume --out {s.run_dir} continues it"
        if s.stopped
        else f"last record {age}"
        if age
        else "no records"
    )
    loss = f", loss {s.last_loss:.3f}" if s.last_loss is not None else ""
    evals = f", eval loss {s.eval_loss:.3f}" if s.eval_loss is not None else ""
    speed = f", {s.tokens_per_s:,.0f} tok/s over the last steps" if s.tokens_per_s is not None else ""
    lines = [
        f"{s.run_dir}: step {s.step}{target} ({state}), {s.tokens:,} tokens{loss}{evals}{speed}",
        f"checkpoint: {s.checkpoint} (step {s.checkpoint_step})" if s.checkpoint else "checkpoint: none yet",
    ]
    if s.incidents:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(s.incidents.items()))
        lines.append(f"incidents: {counts}")
        for r in s.recent_incidents:
            back = f" to step {r['restored_step']}" if r.get("restored_step") is not None else ""
            lines.append(
                f"  {r['kind']}: {r['action']}{back}, detected after {r['detected_after_s']} s (attempt {r['attempt']})"
            )
    else:
        lines.append("incidents: none")
    for line in lines:
        console.print(line, markup=False)


def render_align(report: AlignReport, show: int | None, console: Console) -> None:
    """The set-ups, the tolerance, the routes, the rows chosen, the first failures and the verdict."""
    lines = [f"a: {_side(report.a)}", f"b: {_side(report.b)}", f"tolerance: relative {report.tolerance:g}"]
    routes = _routes(report)
    if routes:
        lines.append(routes)
    rows = _chosen(report.rows, show)
    if show is None:
        shown = "the first failures" if report.failed else "the largest differences"
        lines.append(f"rows: {shown}, in execution order (--show N: the first N entries)")
    lines += _table(rows)
    lines.append(
        f"{len(report.rows)} entries: {report.compared} compared, {report.failed} beyond tolerance, "
        f"{report.one_sided} on one side only"
    )
    for label, row in (("first forward", report.first_forward), ("first backward", report.first_backward)):
        lines.append(f"{label}: " + (f"#{row.index} {row.module} {row.what}" if row else "none"))
    lines.append(f"verdict: {report.verdict}")
    for line in lines:
        console.print(line, markup=False)


def _side(meta: dict[str, Any]) -> str:
    s = meta["setup"]
    spec = f"dtype={s['dtype']},dispatch={s['dispatch']},device={s['device']}"
    if s["workers"] > 1:
        spec += f",workers={s['workers']},mode={s['mode']},balance={s['balance']}"
    spec += "".join(f",{k}={s[k]}" for k in ("checkpoint", "bug") if s.get(k))
    return f"{spec}  ({meta['host']}, {meta['device_name']}, torch {meta['torch']})"


def _routes(report: AlignReport) -> str | None:
    flips = report.route_flips
    if flips is None:
        return None
    near = "unknown" if flips.near_ties is None else str(flips.near_ties)
    ties = f" ({near} at near-ties)" if flips.flipped else ""
    forced = report.routes_forced
    if forced is None:
        return f"routes: {flips.flipped}/{flips.slots} differ{ties}"
    ref = "b" if forced == "a" else "a"
    return f"routes: {forced} ran on {ref}'s; its own top-k would differ in {flips.flipped}/{flips.slots}{ties}"


def _chosen(rows: list[Any], show: int | None) -> list[Any]:
    if show is not None:
        return rows[:show]
    failed = [r for r in rows if r.ok is False]
    if failed:
        return failed[:ALIGN_ROWS]
    closest = sorted((r for r in rows if r.rel_diff is not None), key=lambda r: -r.rel_diff)[:ALIGN_ROWS]
    return sorted(closest, key=lambda r: r.index)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _table(rows: list[Any]) -> list[str]:
    if not rows:
        return []
    width = max(len(r.module) for r in rows)
    what = max(len("entry"), *(len(r.what) for r in rows))
    lines = [f"{'#':>5}  phase  {'module':<{width}}  {'entry':<{what}}  abs diff  rel diff  tol       ok"]
    for r in rows:
        ok = "ok" if r.ok else "-" if r.ok is None else "FAIL"
        note = f"  {r.note}" if r.note else ""
        lines.append(
            f"{r.index:>5}  {r.phase:<5}  {r.module:<{width}}  {r.what:<{what}}  "
            f"{_num(r.abs_diff):<8}  {_num(r.rel_diff):<8}  {r.tol:<8.0e}  {ok}{note}"
        )
    return lines
