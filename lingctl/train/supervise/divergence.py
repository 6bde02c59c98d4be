"""Divergence is not a crash: when a diverged run goes back to a checkpoint and when it ends, and how the
launcher tells an attempt that ended in a divergence from one that crashed.

Restarting a crashed job from its last checkpoint helps: the fault (a killed worker, a lost node) is gone.
Restarting a diverged job as it was does not: the same weights, data and learning rate lead it back to the
same place. So the workers decide (``train/recovery.py``): roll back with a lower learning
rate and the data window skipped, within ``watchdog_config.max_rollbacks``; with local SGD, where one worker
diverges alone, end the attempt so that the launcher restarts the job from the checkpoint with the rollback
applied; otherwise give up. Each decision is a ``divergence`` incident in ``RUN/incidents.jsonl``, written
before the worker exits, and the launcher reads the one that ended its attempt (:func:`attempt_ending`): a
``give_up`` stops the job (exit 1), a ``restart`` is the rollback of local SGD, not a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lingctl.runs import incidents

ENDINGS = ("give_up", "restart")  # the actions by which the workers end their attempt


def give_up_reason(*, watchdog: bool, latest: dict[str, Any] | None, rollbacks: int, budget: int) -> str | None:
    """Why a divergence ends the run instead of going back to the checkpoint ``latest``; None: it may."""
    if not watchdog:
        return "the watchdog is off"
    if latest is None:
        return "there is no checkpoint to go back to"
    if rollbacks >= budget:
        return f"{rollbacks} rollback(s) done"
    return None


def attempt_ending(run_local: Path | None, attempt: int, since_wall: float) -> dict[str, Any] | None:
    """The divergence incident with which the workers of ``attempt`` (started at Unix time ``since_wall``)
    ended it: a ``give_up`` if any worker gave up, else a ``restart``; None when none did (a resumed job
    counts its attempts from 0 again, hence the time)."""
    if run_local is None or not run_local.is_dir():
        return None
    found = [
        r
        for r in incidents.read(run_local)
        if r["kind"] == "divergence"
        and r["action"] in ENDINGS
        and r["attempt"] == attempt
        and (r.get("time") or 0.0) >= since_wall
    ]
    return min(found, key=lambda r: ENDINGS.index(r["action"]), default=None)
