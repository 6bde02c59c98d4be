"""The complete checkpoints of a training run, with the training tokens each had consumed when it was saved.

What evaluating a run checkpoint by checkpoint needs, read from the run's files alone (it may still be
training): ``checkpoints/step-NNNNNNNN/`` directories that are finished, and ``metrics.jsonl`` for their
token counts. A checkpoint directory is finished when it holds ``config.json`` (written last, after the
weights) and its step is at most ``latest.json``'s (``latest.json`` moves only after a checkpoint is whole,
so a newer directory is still being written). Local directories only: an ``s3://`` run is synced first.
Nothing is written, and nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.errors import NotFoundError, UsageError
from lingctl.core.storage import parse_url
from lingctl.model.checkpoint_files import CONFIG, TRAIN_CONFIG, WEIGHTS, WEIGHTS_INDEX
from lingctl.runs.layout import CHECKPOINTS, LATEST, MANIFEST, METRICS, checkpoint_step, parse_latest
from lingctl.runs.records import read_records

__all__ = ["RunCheckpoint", "is_run_dir", "list_checkpoints", "run_finished", "run_target_steps"]

log = logging.getLogger(__name__)

# An object-store URL; a Path built from "s3://b/x" reads "s3:/b/x", so one slash is enough.
_S3 = re.compile(r"^s3a?:/+", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(kw_only=True, slots=True)
class RunCheckpoint:
    step: int
    path: Path  # the checkpoint directory (a Hugging Face model directory)
    tokens: int | None  # training tokens consumed when it was saved; None when metrics.jsonl does not say


def _local(run: Path | str) -> Path:
    """``run`` as a local directory; ``UsageError`` for a run in an object store."""
    text = os.fspath(run)
    if _S3.match(text):
        url = _S3.sub(lambda m: m.group(0).rstrip("/") + "//", text, count=1)
        raise UsageError(
            f"{url} is in an object store: checkpoints are evaluated from a local directory",
            hint=f"evaluate a local copy: lingctl babel sync {url} DIR, then pass DIR",
        )
    return parse_url(text).path


def is_run_dir(path: Path | str) -> bool:
    """Whether ``path`` is a lingctl training run: it has the run manifest, or ``latest.json`` and
    ``checkpoints/`` (a run copied without its manifest). A model directory is not one, nor a URL of another
    scheme than ``file://`` (a hub id, say); ``UsageError`` for an ``s3://`` run (evaluate a local copy)."""
    text = os.fspath(path)
    if _SCHEME.match(text) and not _S3.match(text) and not text.lower().startswith("file://"):
        return False
    path = _local(path)
    return (path / MANIFEST).is_file() or ((path / LATEST).is_file() and (path / CHECKPOINTS).is_dir())


def _latest(run: Path) -> dict[str, Any] | None:
    """``latest.json`` (step and path); None before the first checkpoint is complete."""
    latest = run / LATEST
    if not latest.is_file():
        return None
    return parse_latest(latest.read_bytes(), str(latest))


def _has_weights(directory: Path) -> bool:
    """``model.safetensors``, or an index whose every shard is present."""
    if (directory / WEIGHTS).is_file():
        return True
    index = directory / WEIGHTS_INDEX
    if not index.is_file():
        return False
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return all(isinstance(s, str) and (directory / s).is_file() for s in shards)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _tokens_by_step(run: Path) -> dict[int, int]:
    """Step -> training tokens consumed, from metrics.jsonl: a checkpoint record's ``tokens`` where it has
    one (runs before checkpoint records carried tokens fall back to the step record of that step). The last
    record of a step wins: after a resume from an earlier checkpoint the steps after it are trained again."""
    if not (run / METRICS).is_file():
        return {}
    from_steps: dict[int, int] = {}
    from_checkpoints: dict[int, int] = {}
    for record in read_records(run / METRICS):
        event, step, tokens = record.get("event"), _int(record.get("step")), _int(record.get("tokens"))
        if step is None or tokens is None:
            continue
        if event == "checkpoint":
            from_checkpoints[step] = tokens
        elif event == "step":
            from_steps[step] = tokens
    return from_steps | from_checkpoints


def list_checkpoints(run: Path | str) -> list[RunCheckpoint]:
    """The complete checkpoints of ``run``, ascending by step. ``NotFoundError`` when ``run`` is not a
    training run; an empty list when none is complete yet."""
    root = _local(run)
    if not is_run_dir(root):
        raise NotFoundError(
            f"{root} is not a lingctl training run (no {MANIFEST}, or {LATEST} and {CHECKPOINTS}/)",
            hint="name a run directory of lingctl train, or a checkpoint directory",
        )
    latest = _latest(root)
    if latest is None or not (root / CHECKPOINTS).is_dir():
        return []
    newest = int(latest["step"])
    tokens = _tokens_by_step(root)
    found: list[RunCheckpoint] = []
    for entry in sorted((root / CHECKPOINTS).iterdir()):
        step = checkpoint_step(f"{CHECKPOINTS}/{entry.name}")
        if step is None or not entry.is_dir():
            continue  # not a checkpoint name: the user's file, or a temporary one
        if step > newest:
            log.debug("%s: newer than %s (step %d), still being written", entry, LATEST, newest)
            continue
        if not (entry / CONFIG).is_file():
            log.debug("%s: no %s, not a complete checkpoint", entry, CONFIG)
            continue
        if not _has_weights(entry):
            log.debug("%s: no weights (%s or %s with its shards)", entry, WEIGHTS, WEIGHTS_INDEX)
            continue
        found.append(RunCheckpoint(step=step, path=entry, tokens=tokens.get(step)))
    return sorted(found, key=lambda c: c.step)


def run_target_steps(run: Path | str) -> int | None:
    """The steps the run was asked for, from its latest checkpoint's training config (as ``train status``
    reads it); None before the first checkpoint or when the config does not say."""
    root = _local(run)
    latest = _latest(root)
    if latest is None:
        return None
    try:
        steps = json.loads((root / latest["path"] / TRAIN_CONFIG).read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _int(steps)


def run_finished(run: Path | str) -> bool:
    """Whether the run's latest checkpoint is at (or past) its target steps: no more checkpoints will come."""
    target = run_target_steps(run)
    latest = _latest(_local(run))
    return target is not None and latest is not None and int(latest["step"]) >= target
