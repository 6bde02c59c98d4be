"""``RUN/metrics.jsonl`` as the training loop writes it: open while the loop runs, one JSON line per record,
flushed at once (a reader of a live run sees every step), and cut back to a checkpoint on resume.

Only rank 0 writes the run's metrics (``path`` None elsewhere: its records reach only the live view).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from lingctl.runs import records
from lingctl.runs.records import Record


class MetricsLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def start_new(self) -> None:
        """A new run: an empty file."""
        if self.path is not None:
            self.path.write_text("")

    def open(self) -> None:
        if self.path is not None:
            self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, record: Record) -> None:
        """One record, while the file is open (records before the loop starts reach the live view only)."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def cut_back(self, step: int) -> list[Record]:
        """Back to the checkpoint of ``step`` (``records.cut_back``); the dropped step records."""
        return records.cut_back(self.path, step) if self.path is not None else []
