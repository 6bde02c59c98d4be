"""The names of a run directory, and the two small JSON files that say what is in it.

``lingctl-run.json`` (the manifest) lists every name lingctl created in the run directory. It is the first
file written into a new run directory, a name is listed before it is created, and only listed names are
ever overwritten or deleted (checkpoint pruning, cleaning a staging directory): a run directory can share
its place with the user's own files, or a downloaded ``checkpoints/`` tree, without lingctl touching them.

``latest.json`` names the checkpoint a resume starts from.

A run's default name is ``runs/PRESET-TIME``; an ``s3://`` run is written first into a local staging
directory, named after its URL under the cache (``--cache-dir``).

Both are data that anyone may have edited, so their names are checked before they are joined to a path
(``lingctl.core.names``), and only names of the run layout are accepted: a manifest listing ``../x`` or
``notes.txt`` is damaged (exit 4), so a crafted one cannot aim a deletion anywhere else.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingctl.core.cache import cache_dir as lingctl_cache_dir
from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.names import check_relative, printable
from lingctl.core.storage.url import StoreURL, parse_url
from lingctl.model.checkpoint_files import TOKENIZER

MANIFEST = "lingctl-run.json"
FORMAT = "lingctl-run"
VERSION = 1

LATEST = "latest.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# The files at the top of a run directory, besides the manifest and the checkpoints.
RUN_FILES = (TOKENIZER, METRICS, LATEST)
# What the run records about its incidents: one line per incident, and the files they point to (a hang's
# verdict with the stacks, the step records a restart abandoned).
INCIDENTS = "incidents.jsonl"
INCIDENT_DIR = "incidents"
INCIDENT_FILES = (INCIDENTS, INCIDENT_DIR)
# Written at the end of a local run when the name is free (``lingctl train plot``'s default output).
PLOT = "loss.png"
# A DPO run's reference log-probabilities, computed once from the starting checkpoint (a resume reads them).
REFERENCE = "reference_logps.json"
# Where --report-to tensorboard and wandb write, inside the run directory.
REPORT_DIRS = ("tensorboard", "wandb")

_CHECKPOINT = re.compile(r"checkpoints/step-(\d{8})")


def default_run_dir(preset: str) -> str:
    """Where a run goes without --out: ``runs/PRESET-YYYYmmdd-HHMMSS``."""
    return str(Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}")


def staging_dir(url: StoreURL, cache_dir: Path | None = None) -> Path:
    """The local directory an ``s3://`` run at ``url`` is written in first (under ``cache_dir``, by default
    lingctl's cache), one per URL."""
    base = Path(cache_dir) if cache_dir is not None else lingctl_cache_dir("runs")
    return base / hashlib.sha256(str(url).encode()).hexdigest()[:16]


def local_dir(out: str, cache_dir: Path | None = None) -> Path:
    """The local directory of the run at ``out``: itself, or for an ``s3://`` run its staging directory."""
    url = parse_url(out)
    return staging_dir(url, cache_dir) if url.is_s3 else url.path


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint name (``checkpoints/step-00000050`` -> 50); None for any other name."""
    m = _CHECKPOINT.fullmatch(name)
    return int(m.group(1)) if m else None


def is_layout_name(name: str) -> bool:
    """Whether ``name`` is one lingctl creates in a run directory (and so may appear in a manifest)."""
    return (
        name in RUN_FILES
        or name in INCIDENT_FILES
        or name in (PLOT, REFERENCE)
        or name in REPORT_DIRS
        or checkpoint_step(name) is not None
    )


@dataclass(kw_only=True, slots=True)
class Manifest:
    entries: set[str] = field(default_factory=set)

    def to_bytes(self) -> bytes:
        return (
            json.dumps({"format": FORMAT, "version": VERSION, "entries": sorted(self.entries)}, indent=1) + "\n"
        ).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Manifest:
        """The manifest in ``raw`` (read from ``where``); ``VerificationError`` (exit 4) unless it is one
        lingctl could have written, ``UsageError`` when a newer lingctl wrote it."""
        hint = f"{MANIFEST} is written by lingctl only; restore it, or start a new run with another --out"
        try:
            data = json.loads(raw)
        except ValueError:
            raise VerificationError(f"{where} is damaged: not JSON", hint=hint) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise VerificationError(f"{where} is not a lingctl run manifest", hint=hint)
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise VerificationError(f"{where} is damaged: version {version!r}", hint=hint)
        if version > VERSION:
            raise UsageError(
                f"{where} was written by a newer lingctl (manifest version {version})",
                hint="upgrade lingctl to continue this run",
            )
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise VerificationError(f"{where} is damaged: 'entries' is not a list", hint=hint)
        for name in entries:
            check_relative(name, what=f"{where} entry")
            if not is_layout_name(name):
                raise VerificationError(f"{where} lists {printable(name)!r}, which lingctl never writes", hint=hint)
        return cls(entries=set(entries))


def parse_latest(raw: bytes, where: str) -> dict[str, Any]:
    """``{"step": N, "path": "checkpoints/step-NNNNNNNN"}`` from ``latest.json``; anything else is refused
    (``UnsafeNameError`` for a path that could leave the run directory, ``VerificationError`` otherwise)."""
    hint = "point it at a complete checkpoints/step-* directory of this run"
    try:
        data = json.loads(raw)
    except ValueError:
        raise VerificationError(f"{where} is damaged: not JSON", hint=hint) from None
    if not isinstance(data, dict):
        raise VerificationError(f"{where} is damaged: not a JSON object", hint=hint)
    step, path = data.get("step"), data.get("path")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise VerificationError(f"{where} is damaged: step {step!r} is not a step number", hint=hint)
    path = check_relative(path, what=f"{where} path")
    if checkpoint_step(path) is None:
        raise VerificationError(
            f"{where} is damaged: path {printable(path)!r} is not checkpoints/step-NNNNNNNN", hint=hint
        )
    return {"step": step, "path": path}
