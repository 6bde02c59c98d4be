"""``RUN/incidents.jsonl``: one JSON line per incident the run met and what was done about it; and
``RUN/incidents/``, the files an incident points to (a hang's verdict, the step records a restart abandoned).

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

from lingctl.core.atomic import atomic_write
from lingctl.runs.layout import INCIDENT_DIR, INCIDENTS
from lingctl.runs.records import is_int, is_number, read_records

KINDS = ("hang", "crash", "divergence", "straggler", "routing")
ACTIONS = ("restart", "rollback", "warn", "give_up")

# The files under RUN/incidents/ (a resumed job counts its attempts from 0 again: a taken name gets -2, -3 ...).
HANG_VERDICT = "hang-attempt-{attempt}"  # .json: the hang detector's verdict, stacks and all
ABANDONED = "attempt-{attempt}-abandoned"  # .jsonl: the step records a restart took out of metrics.jsonl


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


def write_file(run_local: Path, stem: str, suffix: str, data: bytes) -> str | None:
    """``data`` as a new file ``RUN/incidents/STEM.SUFFIX`` (or ``STEM-2.SUFFIX``, ... when the name is taken);
    its name relative to the run, or None when no name was free. The name is taken exclusively, then the
    content replaces it whole, so a reader never sees half a file and no writer overwrites another's."""
    folder = Path(run_local) / INCIDENT_DIR
    folder.mkdir(exist_ok=True)
    for n in range(1, 100):
        name = f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}"
        try:
            os.close(os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        except FileExistsError:
            continue
        with atomic_write(folder / name) as (_, f):
            f.write(data)
        return f"{INCIDENT_DIR}/{name}"
    return None


def abandoned_records(run_local: Path, attempt: int) -> str | None:
    """The file of step records that the restart after ``attempt`` took out of metrics.jsonl, relative to
    the run (rank 0 of the next attempt writes it); None when there is none."""
    kept = sorted((Path(run_local) / INCIDENT_DIR).glob(ABANDONED.format(attempt=attempt) + "*.jsonl"))
    return f"{INCIDENT_DIR}/{kept[-1].name}" if kept else None


def files(run_local: Path) -> list[str]:
    """incidents.jsonl and the files under incidents/ that exist, relative to the run (what an s3:// run
    uploads)."""
    run_local = Path(run_local)
    names = [INCIDENTS] if (run_local / INCIDENTS).is_file() else []
    if (run_local / INCIDENT_DIR).is_dir():
        names += sorted(f"{INCIDENT_DIR}/{p.name}" for p in (run_local / INCIDENT_DIR).iterdir() if p.is_file())
    return names
