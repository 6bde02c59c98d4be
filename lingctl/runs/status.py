"""``lingctl train status RUN``: where a run stands, from its files alone (it may be running, stopped or done).

Progress and throughput come from metrics.jsonl, the last checkpoint from latest.json, the incidents from
incidents.jsonl, the target from the checkpoint's saved training config. Nothing is written.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.errors import NotFoundError
from lingctl.runs.checkpoints import run_target_steps
from lingctl.runs.incidents import read as read_incidents
from lingctl.runs.layout import LATEST, METRICS, parse_latest
from lingctl.runs.records import read_records

THROUGHPUT_STEPS = 10  # "current throughput": the mean over this many last steps


@dataclass(kw_only=True, slots=True)
class RunStatus:
    run_dir: str
    step: int  # the last step recorded
    target_steps: int | None  # from the last checkpoint's config (None before the first checkpoint)
    tokens: int
    last_loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None  # mean over the last steps recorded
    last_record_age_s: float | None  # seconds since the last metrics record (a live run writes every step)
    checkpoint: str | None
    checkpoint_step: int | None
    incidents: dict[str, int] = field(default_factory=dict)  # count by kind
    recent_incidents: list[dict[str, Any]] = field(default_factory=list)  # the last few, without details
    finished: bool = False
    stopped: str | None = None  # why the last session stopped early ("interrupted", "time limit"), if it did


def run_status(run: Path, *, recent: int = 5) -> RunStatus:
    run = Path(run)
    if not (run / METRICS).exists() and not (run / LATEST).exists():
        raise NotFoundError(f"{run} is not a lingctl training run (no {METRICS} or {LATEST})")
    records = read_records(run / METRICS) if (run / METRICS).exists() else []
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    latest = parse_latest((run / LATEST).read_bytes(), str(run / LATEST)) if (run / LATEST).exists() else None
    target = run_target_steps(run)
    last = steps[-1] if steps else None
    window = steps[-THROUGHPUT_STEPS:]
    incidents = read_incidents(run)
    return RunStatus(
        run_dir=str(run),
        step=int(last["step"]) if last else int(latest["step"]) if latest else 0,
        target_steps=target,
        tokens=int(last["tokens"]) if last else 0,
        last_loss=float(last["loss"]) if last else None,
        eval_loss=float(evals[-1]["eval_loss"]) if evals else None,
        tokens_per_s=round(sum(float(r["tokens_per_s"]) for r in window) / len(window), 1) if window else None,
        last_record_age_s=round(time.time() - float(records[-1]["time"]), 1)
        if records and "time" in records[-1]
        else None,
        checkpoint=latest["path"] if latest else None,
        checkpoint_step=int(latest["step"]) if latest else None,
        incidents=dict(Counter(str(r.get("kind")) for r in incidents)),
        recent_incidents=[{k: v for k, v in r.items() if k != "details"} for r in incidents[-recent:]],
        finished=target is not None and latest is not None and int(latest["step"]) >= target,
        stopped=str(records[-1].get("reason")) if records and records[-1].get("event") == "stop" else None,
    )
