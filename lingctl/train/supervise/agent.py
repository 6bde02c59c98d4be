"""The restart loop around torchrun: one ``torch.distributed.run --max-restarts=0`` per attempt, and lingctl's
own rules for whether another attempt is worth starting (as torchelastic's agent restarts, but knowing which
failures a restart can fix).

- **crash** (a worker killed by a signal, OOM-killed, or failing with exit 1, as its peers do when it goes):
  restart while the budget lasts.
- **hang** (the hang detector, ``hang_detector.py``, saw no progress for the hang timeout and killed the workers):
  restart while the budget lasts; the verdict goes to ``RUN/incidents/hang-attempt-K.json``.
- **divergence** (the workers recorded that they ended the attempt over a divergence, ``divergence.py``): a
  ``give_up`` stops the job with exit 1, since a restart would diverge again; a ``restart`` (local SGD, one
  worker diverged alone) is that worker's rollback: restarted, recorded as a divergence, not a crash.
- bad settings (2), not found (3), verification failed (4) and a stop asked for (130, or Ctrl-C, SIGINT,
  SIGTERM or SIGHUP to the launcher, which passes it on: ``signal_relay.py``): never restarted; the same
  input would fail the same way, and a stop is a stop.

Restarts wait ``backoff_s`` (1 s, 2 s, 4 s, ... at most 30 s). Workers learn their attempt from
``LINGCTL_ATTEMPT`` (``torchrun.ATTEMPT_ENV``, read by ``workers.start``): a worker of attempt k > 0 resumes from the run's last checkpoint and
fires no fault drill. Each attempt is a fresh ``--standalone`` rendezvous (a new port).

Each incident becomes one line of ``RUN/incidents.jsonl`` (``incidents.append``), written once the next attempt
is stepping again (so it carries the time to recover), or when the job ends first.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.errors import UsageError
from lingctl.core.names import printable
from lingctl.runs import incidents
from lingctl.runs.incidents import Incident
from lingctl.runs.layout import LATEST, METRICS, parse_latest
from lingctl.runs.metrics_tail import MetricsTail
from lingctl.train.supervise import divergence
from lingctl.train.supervise.hang_detector import TRACE_TARGETS, HangDetector, HangVerdict
from lingctl.train.supervise.signal_relay import SignalRelay
from lingctl.train.supervise.torchrun import job_exit_code, launch_argv, launch_env, relay_stderr

log = logging.getLogger(__name__)

NEVER_RESTART = {2: "bad settings", 3: "not found", 4: "verification failed", 130: "stopped"}
RESTARTS_WHEN_WATCHING = 3  # the restart budget when the launcher watches for hangs (--watchdog)
BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 30.0
_POLL_S = 0.25
TORCHRUN_GRACE_S = 60.0  # after the hang detector killed the workers, torchrun has this long to notice and end
TRACE_OUT_ENV = "LINGCTL_TIMER_OUT"  # set when the launcher itself runs under `lingctl timer run`


@dataclass(kw_only=True, slots=True)
class JobOptions:
    nproc: int
    max_restarts: int | None = None  # None: RESTARTS_WHEN_WATCHING when watching, else 0
    watchdog: bool | None = None  # --watchdog/--no-watchdog: watch for hangs; None: on when nproc > 1
    hang_timeout_s: float | None = None  # None: derived from the run's step and save times (hang_detector.py)
    run_local: Path | None = None  # the run's local directory (the staging directory of an s3:// run)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc must be at least 1, got {self.nproc}")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise UsageError(f"--hang-timeout must be more than 0, got {self.hang_timeout_s:g} s")
        if self.hang_timeout_s is not None and not self.watching:
            raise UsageError("--hang-timeout needs the watchdog", hint="drop --no-watchdog, or drop --hang-timeout")

    @property
    def watching(self) -> bool:
        """Whether the launcher watches the workers for hangs (and the workers roll a divergence back)."""
        return self.nproc > 1 if self.watchdog is None else self.watchdog

    @property
    def restarts(self) -> int:
        if self.max_restarts is not None:
            return self.max_restarts
        return RESTARTS_WHEN_WATCHING if self.watching else 0


def backoff_s(restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1 first): 1, 2, 4, ... capped at BACKOFF_CAP_S."""
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** max(0, restart - 1))


def restartable(code: int, *, hung: bool = False, stopped: bool = False) -> bool:
    """Whether an attempt that ended with job exit code ``code`` is worth another attempt."""
    if stopped:
        return False
    if hung:
        return True
    return code != 0 and code not in NEVER_RESTART


@dataclass(slots=True)
class Outcome:
    """How one attempt ended."""

    attempt: int
    code: int  # the job's exit code (0 ok; the failed workers' code otherwise)
    failures: list[tuple[int, int]]  # (rank, exit code) from torchrun's report, root cause first
    verdict: HangVerdict | None  # the hang detector's, when it killed the attempt
    death_mono: float | None  # when the hang detector first saw a worker gone
    ended_mono: float
    ended_wall: float
    started_wall: float = 0.0


@dataclass(slots=True)
class _Pending:
    """An incident recorded once training steps again (or the job ends)."""

    incident: Incident
    verdict_wall: float
    since_wall: float  # step records at or after this moment are the new attempt's


@dataclass(slots=True)
class Job:
    argv: list[str]  # the workers' `lingctl train` options
    options: JobOptions
    _signals: SignalRelay = field(default_factory=SignalRelay)
    _metrics: MetricsTail | None = None
    _pending: _Pending | None = None
    _counts: dict[str, int] = field(default_factory=lambda: {"hang": 0, "crash": 0})

    @property
    def stopping(self) -> bool:
        """A stop was asked for (a signal to the launcher); the attempt running got it too."""
        return self._signals.stopping

    def run(self) -> int:
        opts = self.options
        if opts.run_local is not None:
            self._metrics = MetricsTail(opts.run_local / METRICS)
        trace_dir = self._trace_dir() if opts.watching else None
        # Under `lingctl timer run` the workers are traced already, into the user's directory: keep it.
        own_trace = trace_dir is not None and not os.environ.get(TRACE_OUT_ENV)
        try:
            with self._signals:
                attempt = 0
                while True:
                    outcome = self._attempt(attempt, trace_dir)
                    code = self._after(outcome)
                    if code is not None:
                        return code
                    attempt += 1
                    if not self._sleep(backoff_s(attempt)):
                        self._settle_pending()
                        return 130
        finally:
            if own_trace and trace_dir is not None:
                shutil.rmtree(trace_dir, ignore_errors=True)

    # -- one attempt ----------------------------------------------------------------------------------
    def _attempt(self, attempt: int, trace_dir: Path | None) -> Outcome:
        env = launch_env(self.options.nproc, attempt)
        if trace_dir is not None and not env.get(TRACE_OUT_ENV):
            from lingctl.timer.launch import traced_env

            env = traced_env(trace_dir, TRACE_TARGETS, base=env)
        debug = os.environ.get("LINGCTL_DEBUG", "") not in ("", "0")
        started_wall = time.time()
        proc = subprocess.Popen(
            launch_argv(self.options.nproc, self.argv),
            env=env,
            stderr=None if debug else subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,  # signals reach it through the launcher only (signal_relay.py)
        )
        if self._pending is not None:
            self._pending.since_wall = started_wall
        codes: list[int] = []
        failures: list[tuple[int, int]] = []
        relay = None
        if not debug:
            relay = threading.Thread(target=relay_stderr, args=(proc.stderr, codes, failures), daemon=True)
            relay.start()
        detector = None
        if trace_dir is not None:
            detector = HangDetector(proc.pid, timeout_s=self.options.hang_timeout_s, metrics=self._metrics).start()
        try:
            rc = self._wait(proc, detector)
        finally:
            if detector is not None:
                detector.stop()
        if relay is not None:
            relay.join(timeout=5)
        return Outcome(
            attempt=attempt,
            code=0 if rc == 0 else job_exit_code(codes),
            failures=failures,
            verdict=detector.verdict if detector is not None else None,
            death_mono=detector.first_death_mono if detector is not None else None,
            ended_mono=time.monotonic(),
            ended_wall=time.time(),
            started_wall=started_wall,
        )

    def _wait(self, proc: subprocess.Popen, detector: HangDetector | None) -> int:
        while True:
            self._signals.pass_on(proc)  # a stop asked for: the workers finish their step, save and exit
            try:
                return proc.wait(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                self._check_recovery()
                verdict = detector.verdict if detector is not None else None
                if verdict is not None and time.time() - verdict.time > TORCHRUN_GRACE_S:
                    proc.kill()  # its workers are gone, yet torchrun did not end: it cannot be waited for

    def _sleep(self, seconds: float) -> bool:
        """Wait before a restart; False when a stop came meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return not self.stopping

    # -- deciding -------------------------------------------------------------------------------------
    def _after(self, out: Outcome) -> int | None:
        """The job's exit code when it ends here; None to start another attempt."""
        self._settle_pending()
        if out.code == 0 and out.verdict is None:
            return 0
        if self.stopping:  # a stop asked for: the workers saved and said so; torchrun's own code says less
            return 130
        hung = out.verdict is not None
        code = out.code or 1
        ended = None if hung else divergence.attempt_ending(self.options.run_local, out.attempt, out.started_wall)
        if ended is not None:
            return self._after_divergence(ended, code)
        if not restartable(code, hung=hung, stopped=self.stopping):
            sys.stderr.write(
                f"lingctl: error: training stopped: a worker failed (exit code {code})\n"
                "hint: its error is above; LINGCTL_DEBUG=1 shows the launcher's full report\n"
            )
            return code
        kind = "hang" if hung else "crash"
        self._counts[kind] += 1
        budget, restarts = self.options.restarts, sum(self._counts.values())
        give_up = restarts > budget
        incident = self._incident(out, kind, code, give_up)
        if give_up:
            self._record(incident)
            spent = " and ".join(
                f"{'hung' if k == 'hang' else 'failed'} {n} time{'s' if n != 1 else ''}"
                for k, n in self._counts.items()
                if n
            )
            sys.stderr.write(
                f"lingctl: error: training stopped: a worker {spent}; the restart budget (--max-restarts "
                f"{budget}) is spent\n"
                f"hint: {self._where_recorded()}LINGCTL_DEBUG=1 shows the launcher's full report\n"
            )
            return code
        self._pending = _Pending(
            incident, verdict_wall=out.verdict.time if out.verdict else out.ended_wall, since_wall=0
        )
        what = (
            f"a worker hung ({out.verdict.details.get('summary') or 'no progress'})"
            if out.verdict
            else f"a worker failed ({_failure_text(out, code)})"
        )
        log.warning(
            "%s; restarting from the last checkpoint (step %s) in %g s, restart %d of %d",
            what,
            incident.restored_step,
            backoff_s(out.attempt + 1),
            restarts,
            budget,
        )
        return None

    def _after_divergence(self, ended: dict[str, Any], code: int) -> int | None:
        """The workers ended the attempt over a divergence, and recorded how: the job stops when they gave up
        (a restart would diverge again); it restarts when one worker of local SGD diverged alone, which is
        that worker's rollback (the restarted job applies it), within the workers' rollback budget."""
        details = ended.get("details") or {}
        reason = printable(str(details.get("reason")))
        if ended["action"] == "give_up":
            sys.stderr.write(
                f"lingctl: error: training stopped: it diverged ({reason}; {printable(str(details.get('why')))}); "
                "not restarted, since a restart would diverge again\n"
                f"hint: {self._where_recorded()}start a new run with a lower --lr\n"
            )
            return code
        log.warning(
            "worker %s diverged (%s); restarting from the last checkpoint (step %s) with the learning rate x%s "
            "and the data since then skipped, rollback %s",
            ",".join(map(str, ended["ranks"])),
            reason,
            ended.get("restored_step"),
            details.get("lr_factor"),
            details.get("rollback"),
        )
        return None

    def _incident(self, out: Outcome, kind: str, code: int, give_up: bool) -> Incident:
        last_step = self._metrics.last_step() if self._metrics else None
        restored = None if give_up else self._latest_step()
        lost = last_step - restored if last_step is not None and restored is not None else None
        if out.verdict is not None:
            v = out.verdict
            verdict_file = self._write_verdict(out.attempt, v)
            details: dict[str, Any] = {
                "collective": v.collective,
                "summary": v.details.get("summary"),
                "timeout_s": round(v.timeout_s, 3),
                "onset": v.onset,
                "last_step": last_step,
                "verdict": verdict_file,
            }
            return Incident(
                kind="hang",
                action="give_up" if give_up else "restart",
                ranks=v.ranks,
                detected_after_s=v.detected_after_s,
                restored_step=restored,
                lost_steps=max(0, lost) if lost is not None else None,
                attempt=out.attempt,
                details=details,
            )
        # The report's root cause (its first failure), and any other worker that failed in its own way: not
        # with exit 1 (a peer went) nor SIGTERM (torchrun stopping the survivors).
        own = [r for i, (r, c) in enumerate(out.failures) if i == 0 or c not in (1, -signal.SIGTERM)]
        details = {
            "exit_code": code,
            "failures": [{"rank": r, "exit_code": c} for r, c in out.failures],
            "last_step": last_step,
        }
        if out.failures and out.failures[0][1] < 0:  # the root cause was killed by a signal
            details["signal"] = _signal_name(-out.failures[0][1])
        detected = out.ended_mono - out.death_mono if out.death_mono is not None else None
        return Incident(
            kind="crash",
            action="give_up" if give_up else "restart",
            ranks=sorted(set(own)),
            detected_after_s=round(detected, 3) if detected is not None else None,
            restored_step=restored,
            lost_steps=max(0, lost) if lost is not None else None,
            attempt=out.attempt,
            details=details,
        )

    # -- records --------------------------------------------------------------------------------------
    def _check_recovery(self) -> None:
        """Record the pending incident once the new attempt has written a step."""
        p = self._pending
        if p is None or self._metrics is None or not p.since_wall:
            return
        self._metrics.poll()
        first = self._metrics.first_step_since(p.since_wall)
        if first is not None:
            p.incident.recovery_s = round(max(0.0, first[1] - p.verdict_wall), 3)
            p.incident.details["first_step"] = first[0]
            self._record(p.incident)
            self._pending = None

    def _settle_pending(self) -> None:
        """Record the pending incident: recovered if a step came, else with no recovery time."""
        self._check_recovery()
        if self._pending is not None:
            self._record(self._pending.incident)
            self._pending = None

    def _record(self, incident: Incident) -> None:
        run = self.options.run_local
        if run is None or not run.is_dir():  # the run never got a directory: nothing to write into
            log.warning("incident not recorded (no run directory): %s", incident.to_record())
            return
        # The step records the restart took out of metrics.jsonl (rank 0 of the next attempt keeps them there).
        kept = incidents.abandoned_records(run, incident.attempt)
        if kept and incident.action == "restart":
            incident.details["abandoned_records"] = kept
        incidents.append(run, incident)

    def _write_verdict(self, attempt: int, v: HangVerdict) -> str | None:
        run = self.options.run_local
        if run is None or not run.is_dir():
            return None
        data = {
            "kind": "hang",
            "attempt": attempt,
            "ranks": v.ranks,
            "collective": v.collective,
            "detected_after_s": v.detected_after_s,
            "onset": v.onset,
            "time": v.time,
            **v.details,
        }
        text = json.dumps(data, indent=1, default=str) + "\n"
        return incidents.write_file(run, incidents.HANG_VERDICT.format(attempt=attempt), ".json", text.encode())

    def _latest_step(self) -> int | None:
        run = self.options.run_local
        if run is None or not run.is_dir():
            return None
        try:
            return int(parse_latest((run / LATEST).read_bytes(), str(run / LATEST))["step"])
        except FileNotFoundError:
            return 0  # no checkpoint yet: the next attempt starts from the beginning
        except Exception:
            return None

    def _where_recorded(self) -> str:
        run = self.options.run_local
        return f"the incidents are in {run / incidents.INCIDENTS}; " if run is not None and run.is_dir() else ""

    def _trace_dir(self) -> Path | None:
        """A private directory for the workers' trace logs (the rings themselves are in shared memory); the
        hang detector reads the rings, so the logs are not kept after the job."""
        from lingctl.core.errors import LingctlError
        from lingctl.timer.ring import ensure_ring_dir

        try:
            ensure_ring_dir()
        except LingctlError as err:
            log.warning("the watchdog is off: %s%s", err, f" ({err.hint})" if err.hint else "")
            return None
        if os.environ.get(TRACE_OUT_ENV):
            return Path(os.environ[TRACE_OUT_ENV])
        return Path(tempfile.mkdtemp(prefix="lingctl-trace-"))


def _failure_text(out: Outcome, code: int) -> str:
    if out.failures:
        rank, c = out.failures[0]
        return f"rank {rank} killed by {_signal_name(-c)}" if c < 0 else f"rank {rank}, exit code {c}"
    return f"exit code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
