"""The launcher's hang detector: tells a hung job from a slow one by reading every worker's trace ring from
outside.

Each worker runs with the timer's tracer (``lingctl.timer``), whose shared-memory ring says, at no cost to the
worker, how many traced calls it has finished (collectives, point-to-point, optimizer steps, forwards, data
loads), its step count and what it is inside right now. A thread in the launcher reads the rings' headers every
``POLL_S``; the ranks' hot path never sees it. The job is **hung** when every worker is alive and none of them
has finished a traced call for the hang timeout: then the timer's diagnosis names the rank that never arrived,
the collective the others wait in and the stuck rank's Python stacks, and the workers are killed (SIGKILL: a
rank blocked in a collective never reads a gentler signal) so that the launcher can restart them.

Before an attempt's first step (tokenizing data, building the model, loading a checkpoint) a worker may work
alone for long while the others wait in a broadcast: the detector then waits at least ``STARTUP_GRACE_S``.

The hang timeout, unless given, follows the run's own figures in ``RUN/metrics.jsonl`` (``MetricsTail``):
max(``MIN_HANG_TIMEOUT_S``, ``STEP_FACTOR`` x the median step time), and never shorter than ``SAVE_FACTOR`` x
the longest checkpoint save seen (a save is file I/O with no traced call).
"""

from __future__ import annotations

import logging
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lingctl.runs.metrics_tail import MetricsTail

log = logging.getLogger(__name__)

POLL_S = 0.5
MIN_HANG_TIMEOUT_S = 25.0  # detection within 30 s of the onset with the default
STEP_FACTOR = 10.0
SAVE_FACTOR = 2.0
STARTUP_GRACE_S = 600.0
STEP_WINDOW = 50  # the median step time is taken over this many latest steps
TRACE_TARGETS = "-copy"  # every traced call but host-device copies (many small calls; no help against hangs)


def hang_timeout(explicit: float | None, step_times: list[float], longest_save_s: float | None) -> float:
    """The hang timeout: ``explicit`` when given, else derived from the run's step times and saves."""
    if explicit is not None:
        return explicit
    timeout = MIN_HANG_TIMEOUT_S
    if step_times:
        timeout = max(timeout, STEP_FACTOR * statistics.median(step_times[-STEP_WINDOW:]))
    if longest_save_s:
        timeout = max(timeout, SAVE_FACTOR * longest_save_s)
    return timeout


@dataclass(slots=True)
class _Worker:
    pid: int
    rank: int
    world: int
    create_time: float
    reader: Any = None  # RingReader once the worker's ring is there
    signature: tuple[int, int] = (-1, -1)  # (records written, steps): progress is a change of either
    step: int = 0
    enabled: bool = True  # its tracer still records (it disables itself after an internal error)
    gone_mono: float | None = None  # when it died (its last heartbeat) or was first seen gone


@dataclass(kw_only=True, slots=True)
class HangVerdict:
    """What the detector found when it declared a hang (``details`` goes to the verdict file)."""

    ranks: list[int]  # the ranks that never arrived (all ranks when the diagnosis could not tell)
    detected_after_s: float
    timeout_s: float
    onset: float  # Unix time of the last progress
    time: float  # Unix time of the verdict
    collective: dict[str, Any] | None
    details: dict[str, Any] = field(default_factory=dict)


class HangDetector:
    """Watches one attempt: the workers of the torchrun process ``launcher_pid``."""

    def __init__(
        self,
        launcher_pid: int,
        *,
        timeout_s: float | None,
        metrics: MetricsTail | None,
        poll_s: float = POLL_S,
        startup_grace_s: float = STARTUP_GRACE_S,
        on_verdict: Callable[[HangVerdict], None] | None = None,
    ) -> None:
        self.launcher_pid = launcher_pid
        self.explicit_timeout = timeout_s
        self.metrics = metrics
        self.poll_s = poll_s
        self.startup_grace_s = startup_grace_s
        self.on_verdict = on_verdict
        self.verdict: HangVerdict | None = None
        self.first_death_mono: float | None = None  # when the first worker died (a crash's onset)
        self._workers: dict[int, _Worker] = {}
        self._started = time.monotonic()
        self._last_progress = self._started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lingctl-hang-detector", daemon=True)

    def start(self) -> HangDetector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        for w in self._workers.values():
            if w.reader is not None:
                w.reader.close()
                w.reader = None

    def timeout(self) -> float:
        steps = self.metrics.step_times() if self.metrics else []
        return hang_timeout(self.explicit_timeout, steps, self.metrics.longest_save_s if self.metrics else None)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self.check():
                    return
            except Exception as exc:  # the detector must never take the job down: it stops watching
                log.warning("the hang detector stopped watching: %r", exc)
                return

    # -- one look -----------------------------------------------------------------------------------
    def check(self, now: float | None = None) -> bool:
        """Read the rings once; declare a hang (diagnose, kill, keep the verdict) when due. True once done."""
        now = time.monotonic() if now is None else now
        if self.metrics is not None:
            self.metrics.poll()
        self._discover()
        alive = 0
        for w in self._workers.values():
            if not _running(w):
                if w.gone_mono is None:
                    w.gone_mono = self._last_beat(w) or now
                    self.first_death_mono = min(self.first_death_mono or w.gone_mono, w.gone_mono)
                continue
            alive += 1
            if self._read(w):
                self._last_progress = now
        world = max((w.world for w in self._workers.values()), default=0)
        if world == 0 or alive < world or any(w.gone_mono is not None for w in self._workers.values()):
            return False  # starting, or ending (a worker exited): torchrun sees exits, the detector hangs
        if any(w.reader is None or not w.enabled for w in self._workers.values()):
            return False  # a worker without a working tracer (none started, or it disabled itself) cannot be judged
        stepped = any(w.step > 0 for w in self._workers.values())
        if not stepped and now - self._started < self.startup_grace_s:
            return False
        timeout = self.timeout()
        if now - self._last_progress < timeout:
            return False
        verdict = self._verdict(timeout)
        self.verdict = verdict
        self._kill()
        if self.on_verdict is not None:
            self.on_verdict(verdict)
        return True

    def _discover(self) -> None:
        """The attempt's workers: torchrun's children with a RANK in their environment (its own ring, as a
        traced Python process, is not a worker's; a worker's own children inherit RANK but are not workers)."""
        import psutil

        try:
            children = psutil.Process(self.launcher_pid).children()
        except psutil.Error:
            return
        for child in children:
            if child.pid in self._workers:
                continue
            try:
                env = child.environ()
                if "RANK" not in env:
                    continue
                self._workers[child.pid] = _Worker(
                    child.pid, int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), child.create_time()
                )
            except (psutil.Error, ValueError):
                continue

    def _read(self, w: _Worker) -> bool:
        """Read a worker's ring header; True when it finished a traced call or a step since the last look."""
        from lingctl.timer.attach import find_ring
        from lingctl.timer.ring import RingReader

        if w.reader is None:
            ring = find_ring(w.pid, w.create_time)
            if ring is None:
                return False
            try:
                w.reader = RingReader(ring)
            except (OSError, ValueError):
                return False
        h = w.reader.header()
        signature = (h.write_index, h.step)
        changed = signature != w.signature
        w.signature, w.step, w.enabled = signature, h.step, h.enabled
        return changed

    @staticmethod
    def _last_beat(w: _Worker) -> float | None:
        """A dead worker's last heartbeat (its ring outlives it while mapped): when it died, to 0.1 s."""
        if w.reader is None:
            return None
        beat = w.reader.header().heartbeat_ns
        return beat / 1e9 if beat else None

    def _onset_mono(self) -> float:
        """The last progress on the monotonic clock: the end of the newest traced call of any worker (the
        rings use the machine's monotonic clock, as this process does), else the last change seen."""
        ends = []
        for w in self._workers.values():
            if w.reader is None:
                continue
            h = w.reader.header()
            if h.write_index:
                records, _ = w.reader.records(h.write_index - 1)
                ends += [r.end_ns / 1e9 for r in records]
        return max(ends) if ends else self._last_progress

    def _verdict(self, timeout: float) -> HangVerdict:
        now_mono, now_wall = time.monotonic(), time.time()
        onset = min(self._onset_mono(), now_mono)
        detected_after = now_mono - onset
        pids = sorted(w.pid for w in self._workers.values())
        by_pid = {w.pid: w.rank for w in self._workers.values()}
        details: dict[str, Any] = {
            "timeout_s": round(timeout, 3),
            "workers": {str(by_pid[p]): p for p in pids},
            "last_step": self.metrics.last_step() if self.metrics else None,
        }
        ranks: list[int] = []
        collective = None
        try:
            from lingctl.timer.diagnose import diagnose

            diagnosis = diagnose(pids=pids, hang_after_s=max(0.1, timeout / 2), stacks=True)
            data = diagnosis.to_json()
            for rank in data.get("ranks", []):  # the stacks are kept once, under "stacks"
                rank.pop("stacks", None)
            details["summary"] = diagnosis.summary
            details["diagnosis"] = data
            waiting = [g for g in diagnosis.groups if g.waiting]
            if waiting:
                g = max(waiting, key=lambda g: max(g.waiting.values()))
                collective = {"group": g.group, "op": g.op, "seq": g.seq, "waiting": sorted(g.waiting)}
                ranks = sorted(g.never_arrived)
                collective["never_arrived"] = ranks
            details["stacks"] = {str(r.rank): r.stacks for r in diagnosis.ranks if r.stacks}
        except Exception as exc:  # a diagnosis that fails must not keep a hung job from restarting
            details["diagnosis_error"] = f"{type(exc).__name__}: {exc}"
        if not details.get("stacks"):
            details["stacks"] = self._stacks(ranks or sorted(by_pid.values()))
        details["collective"] = collective
        return HangVerdict(
            ranks=ranks or sorted(by_pid.values()),
            detected_after_s=round(detected_after, 3),
            timeout_s=timeout,
            onset=round(now_wall - detected_after, 3),
            time=round(now_wall, 3),
            collective=collective,
            details=details,
        )

    def _stacks(self, ranks: list[int]) -> dict[str, str]:
        from lingctl.timer.attach import find_ring, request_stacks

        out = {}
        for w in self._workers.values():
            if w.rank not in ranks:
                continue
            ring = find_ring(w.pid, w.create_time)
            text = request_stacks(w.pid, ring) if ring is not None else None
            if text:
                out[str(w.rank)] = text
        return out

    def _kill(self) -> None:
        import psutil

        for w in self._workers.values():
            try:
                proc = psutil.Process(w.pid)
                if abs(proc.create_time() - w.create_time) < 0.01:  # not a later process with the same pid
                    proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


def _running(w: _Worker) -> bool:
    import psutil

    try:
        proc = psutil.Process(w.pid)
        return abs(proc.create_time() - w.create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
