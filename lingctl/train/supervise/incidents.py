"""``RUN/incidents.jsonl``: one JSON line per incident the run met and what was done about it.

Written by whoever handled the incident: the launcher for hangs and crashes (it restarts the workers), rank 0
for divergence (rolled back in the workers) and for straggler and routing warnings. Each line is appended
with one ``write`` on a file opened for appending, so two writers never interleave within a line.

Every record has at least:

    kind              hang | crash | divergence | straggler | routing
    action            restart | rollback | warn | give_up
    ranks             the ranks concerned (the one that never arrived, the one that died, all for divergence)
    detected_after_s  seconds from the onset (last progress, the bad step, the death) to the verdict
    restored_step     the checkpoint step the run went back to (None: no recovery)
    lost_steps        steps taken after that checkpoint and done again
    recovery_s        seconds from the verdict until training was stepping again (None: not recovered)
    time              Unix seconds when the record was written
    attempt           the job's attempt (0 first; +1 at each restart)

and ``details``: what the verdict rests on (the collective and the stacks, the exit code, the loss and the
skipped data window, the figures of a warning).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lingctl.runs.layout import INCIDENT_DIR, INCIDENTS  # noqa: F401 (the names live with the run layout)
from lingctl.runs.records import is_int, is_number, read_records

KINDS = ("hang", "crash", "divergence", "straggler", "routing")
ACTIONS = ("restart", "rollback", "warn", "give_up")


@dataclass(kw_only=True, slots=True)
class Incident:
    kind: str
    action: str
    ranks: list[int]
    detected_after_s: float | None
    restored_step: int | None = None
    lost_steps: int | None = None
    recovery_s: float | None = None
    attempt: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"incident kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"incident action {self.action!r} is not one of {', '.join(ACTIONS)}")

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["time"] = self.time or round(time.time(), 3)
        return record


def append(run_local: Path, incident: Incident) -> dict[str, Any]:
    """Add ``incident`` to ``run_local/incidents.jsonl`` (created if missing); returns the record written."""
    record = incident.to_record()
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(Path(run_local) / INCIDENTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def read(run_local: Path) -> list[dict[str, Any]]:
    """The run's incident records, oldest first; a torn last line (a writer killed mid-write) is skipped, and
    so is a record of other types than ``append`` writes, with a warning naming its line."""
    path = Path(run_local) / INCIDENTS
    return read_records(path, check=check_incident) if path.exists() else []


def check_incident(record: dict[str, Any]) -> str | None:
    """Why ``record`` is not an incident as ``append`` writes it; None when it is. A resume reapplies the
    rollbacks it finds (their learning-rate factor and skipped data window), so those fields are checked too."""
    if not all(isinstance(record.get(k), str) for k in ("kind", "action")):
        return "kind and action are not text"
    if not is_int(record.get("attempt")):
        return "attempt is not a whole number"
    if "detected_after_s" not in record:
        return "no detected_after_s"
    ranks = record.get("ranks")
    if not isinstance(ranks, list) or not all(is_int(r) for r in ranks):
        return "ranks is not a list of ranks"
    for key in ("detected_after_s", "recovery_s", "time"):
        if record.get(key) is not None and not is_number(record[key]):
            return f"{key} is not a number"
    for key in ("restored_step", "lost_steps"):
        if record.get(key) is not None and not is_int(record[key]):
            return f"{key} is not a whole number"
    details = record.get("details", {})
    if not isinstance(details, dict):
        return "details is not an object"
    if record["kind"] == "divergence" and record["action"] in ("rollback", "restart"):
        window = details.get("skipped_window")
        if not (isinstance(window, list) and len(window) == 2 and is_int(window[1])):
            return "skipped_window is not [from, to]"
        if not is_number(details.get("lr_factor", 1.0)):
            return "lr_factor is not a number"
    return None
