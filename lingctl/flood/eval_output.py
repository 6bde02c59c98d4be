"""The files of one model's evaluation: ``OUT.jsonl`` (one record per item, in task-file order), its manifest
``OUT.jsonl.manifest.json`` (what produced it), and while it runs a journal ``OUT.jsonl.partial``.

Items are appended to the journal as they finish, so an interrupted evaluation continues where it stopped
when the same command runs again (the manifest must match). When every item is done the output is written
whole, in file order, and the journal removed: two evaluations of one checkpoint give identical files.

An output that already exists is reused when its manifest matches (an evaluation is deterministic, so
running it again would write the same bytes) and refused otherwise: lingctl never overwrites a file it did
not write, nor an evaluation made with other settings.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import UsageError, os_error
from lingctl.flood.batch_output import JsonlSink, check_manifest, has_content, manifest_path, scan_jsonl
from lingctl.flood.eval_tasks import Task

log = logging.getLogger(__name__)

FORMAT = "lingctl-eval"
VERSION = 1
ENGINE_VERSION = "flood/1"
_HINT = "choose another -o, or move the old output away"


def eval_manifest(
    *,
    model: str,
    fingerprint: str,
    tasks: list[Task],
    num_fewshot: int,
    dtype: str,
    quantize: str | None,
    chunk: int,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "engine": ENGINE_VERSION,
        "model": model,
        "model_fingerprint": fingerprint,
        "dtype": dtype,
        "quantize": quantize,
        "prompt_chunk": chunk,
        "num_fewshot": num_fewshot,
        "tasks": [{"name": t.name, "sha256": t.sha256} for t in tasks],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # What changes the numbers; batch size, threads, cache size and prefix sharing do not.
        "compare": [
            "format",
            "engine",
            "model_fingerprint",
            "dtype",
            "quantize",
            "prompt_chunk",
            "num_fewshot",
            "tasks",
        ],
    }


def journal_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _ours(path: Path) -> bool:
    """The manifest at ``path`` was written by flood eval."""
    try:
        return json.loads(path.read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class ResultsFile:
    """One model's results. ``done`` holds the records already written (all of them when ``complete``)."""

    def __init__(self, out: Path, manifest: dict[str, Any]) -> None:
        self.out = Path(out)
        self.manifest_path = manifest_path(self.out)
        self.journal = journal_path(self.out)
        self.done: list[dict[str, Any]] = []
        self.complete = False
        self._sink: JsonlSink | None = None
        has_manifest = has_content(self.manifest_path)
        if has_manifest and not _ours(self.manifest_path):
            raise UsageError(f"{self.manifest_path} was not written by lingctl flood eval", hint=_HINT)
        if has_content(self.out):
            if not has_manifest:
                raise UsageError(
                    f"{self.out} already exists and has no manifest ({self.manifest_path.name}), so lingctl did not "
                    "write it",
                    hint=_HINT,
                )
            check_manifest(self.manifest_path, manifest, self.out)
            self._read(self.out)
            self.complete = True
            return
        if has_content(self.journal):
            if not has_manifest:
                raise UsageError(f"{self.journal} has no manifest beside it", hint=_HINT)
            check_manifest(self.manifest_path, manifest, self.out)
            self._read(self.journal)
            log.info("%s: continuing after %d items already evaluated", self.out, len(self.done))
        else:
            try:
                self.out.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(exc, str(self.out.parent)) from exc
            with atomic_write(self.manifest_path) as (_, f):
                f.write(json.dumps(manifest, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")

    def _read(self, path: Path) -> None:
        scan_jsonl(
            path,
            self.done.append,
            valid=lambda r: isinstance(r.get("task"), str) and isinstance(r.get("id"), str),
            hint="fix or remove that line, then run again",
        )

    @property
    def done_keys(self) -> set[tuple[str, str]]:
        return {(r["task"], r["id"]) for r in self.done}

    def append(self, record: dict[str, Any]) -> None:
        if self._sink is None:
            self._sink = JsonlSink(self.journal)
        self._sink.write(record)
        self.done.append(record)

    def finish(self, tasks: list[Task]) -> list[dict[str, Any]]:
        """Write the output whole, in task-file order, then drop the journal; the ordered records."""
        ordered = order_records(tasks, self.done)
        self.close()
        with atomic_write(self.out) as (_, f):
            for record in ordered:
                f.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        try:
            self.journal.unlink(missing_ok=True)
        except OSError as exc:
            raise os_error(exc, str(self.journal)) from exc
        self.done, self.complete = ordered, True
        return ordered

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None


def order_records(tasks: list[Task], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in task-file order (each item once: a journal written twice keeps its first record)."""
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        by_key.setdefault((r["task"], r["id"]), r)
    return [by_key[(t.name, i.id)] for t in tasks for i in t.items if (t.name, i.id) in by_key]
