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
import os
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import UsageError, os_error
from lingctl.flood.batch.jsonl_file import JsonlSink, Written, dumps_line, has_content, read_jsonl
from lingctl.flood.batch.output import (
    OUTPUT,
    check_manifest,
    manifest_path,
    proof_of,
    read_manifest,
    record_written,
    save_manifest,
    sweep_manifest_tmp,
)
from lingctl.flood.engine.manifest import output_manifest
from lingctl.flood.engine.options import EngineOptions
from lingctl.flood.eval.tasks import Task

log = logging.getLogger(__name__)

FORMAT = "lingctl-eval"
VERSION = 1
_HINT = "choose another -o, or move the old output away"
JOURNAL = "journal"  # the manifest's record of OUT.partial (and OUTPUT of OUT itself)


def eval_manifest(
    *, model: str, fingerprint: str, tasks: list[Task], num_fewshot: int | dict[str, int], engine: EngineOptions
) -> dict[str, Any]:
    own = {
        "format": FORMAT,
        "version": VERSION,
        "num_fewshot": num_fewshot,
        "tasks": [{"name": t.name, "sha256": t.sha256} for t in tasks],
    }
    return output_manifest(
        model=model, fingerprint=fingerprint, engine=engine, own=own, compared=["format", "num_fewshot", "tasks"]
    )


def journal_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _valid(record: dict[str, Any]) -> bool:
    return isinstance(record.get("task"), str) and isinstance(record.get("id"), str)


class ResultsFile:
    """One model's results. ``done`` holds the records already written (all of them when ``complete``).

    The manifest records what lingctl wrote to the journal and to the output (``jsonl_file.Written``): the
    journal is continued, cut or removed only when it is that file, and a reused output must hold those bytes.
    """

    def __init__(self, out: Path, manifest: dict[str, Any]) -> None:
        self.out = Path(out)
        self.manifest_path = manifest_path(self.out)
        self.journal = journal_path(self.out)
        self.done: list[dict[str, Any]] = []
        self.complete = False
        self._sink: JsonlSink | None = None
        self._journal_id: tuple[int, int] | None = None  # (device, inode) of the journal this process wrote
        saved = read_manifest(self.manifest_path) if has_content(self.manifest_path) else None
        if saved is not None and saved.get("format") != FORMAT:
            raise UsageError(f"{self.manifest_path} was not written by lingctl flood eval", hint=_HINT)
        if has_content(self.out):
            if saved is None:
                raise UsageError(
                    f"{self.out} already exists and has no manifest ({self.manifest_path.name}), so lingctl did not "
                    "write it",
                    hint=_HINT,
                )
            check_manifest(saved, manifest, self.out)
            # Written whole by a rename: a torn line here is damage, and nothing is cut.
            read_jsonl(
                self.out,
                self.done.append,
                valid=_valid,
                hint=_HINT,
                proof=proof_of(saved, OUTPUT),
                require_proof=False,
                torn_is_damage=True,
            )
            self.complete = True
            return
        sweep_manifest_tmp(self.manifest_path)
        if has_content(self.journal):
            if saved is None:
                raise UsageError(f"{self.journal} has no manifest beside it", hint=_HINT)
            check_manifest(saved, manifest, self.out)
            self._manifest = saved
            self._open_journal()
            log.info("%s: continuing after %d items already evaluated", self.out, len(self.done))
        else:
            try:
                self.out.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(exc, str(self.out.parent)) from exc
            self._manifest = json.loads(json.dumps(manifest))
            save_manifest(self.manifest_path, self._manifest)

    def _open_journal(self) -> None:
        self._sink = JsonlSink.open(
            self.journal,
            proof=proof_of(self._manifest, JOURNAL),
            on_record=self.done.append,
            valid=_valid,
            hint="fix or remove that line, then run again",
            on_sync=lambda written: record_written(self.manifest_path, self._manifest, JOURNAL, written),
        )
        self._journal_id = self._sink.identity

    @property
    def done_keys(self) -> set[tuple[str, str]]:
        return {(r["task"], r["id"]) for r in self.done}

    def append(self, record: dict[str, Any]) -> None:
        if self._sink is None:
            self._open_journal()
        assert self._sink is not None
        self._sink.write(record)
        self.done.append(record)

    def finish(self, tasks: list[Task]) -> list[dict[str, Any]]:
        """Write the output whole, in task-file order, then drop the journal; the ordered records."""
        ordered = order_records(tasks, self.done)
        self.close()
        data = b"".join(dumps_line(record) for record in ordered)
        # Recorded before the rename: a crash in between leaves the journal, and the next run continues from it.
        record_written(self.manifest_path, self._manifest, OUTPUT, Written.of(data))
        with atomic_write(self.out) as (_, f):
            f.write(data)
        self._remove_journal()
        self.done, self.complete = ordered, True
        return ordered

    def _remove_journal(self) -> None:
        """Remove the journal if it is still the file this process wrote (nothing else lingctl did not write)."""
        if self._journal_id is None:
            return
        try:
            st = os.lstat(self.journal)
            if (st.st_dev, st.st_ino) != self._journal_id:
                log.warning("%s was replaced while the evaluation ran; it is left as it is", self.journal)
                return
            self.journal.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, str(self.journal)) from exc

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
