"""The one output layer every command goes through.

stdout carries only the command's result: one JSON document (or JSON lines for streams) with ``--json``,
its human rendering otherwise, so ``lingctl ... | jq`` and ``lingctl ... > file`` always get clean data.
Messages, warnings, logs and progress bars go to stderr. Progress bars are drawn only when stderr is a
terminal and JSON mode is off, so CI logs and pipes never fill with escape codes; a command may force
them (``-P``), or write a one-line summary every few seconds instead (``stats_lines``), so a long job
under a batch scheduler still logs how it goes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths, enums and sets as plain JSON values; NaN/inf become null (JSON has neither)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def dumps(value: Any) -> str:
    return json.dumps(to_jsonable(value), ensure_ascii=False, allow_nan=False)


class _NoProgress:
    """Stands in for a progress task when bars are off, so callers never branch on the mode."""

    def advance(self, amount: float = 1) -> None:
        pass

    def update(
        self, *, total: float | None = None, description: str | None = None, completed: float | None = None
    ) -> None:
        pass


class _Task:
    def __init__(self, progress: Progress, task_id: Any) -> None:
        self._progress = progress
        self._id = task_id

    def advance(self, amount: float = 1) -> None:
        self._progress.advance(self._id, amount)

    def update(
        self, *, total: float | None = None, description: str | None = None, completed: float | None = None
    ) -> None:
        kwargs: dict[str, Any] = {}
        if total is not None:
            kwargs["total"] = total
        if completed is not None:
            kwargs["completed"] = completed
        if description is not None:
            kwargs["description"] = description
        self._progress.update(self._id, **kwargs)


class Output:
    """Where a command's results, messages and progress go. Build one per command invocation."""

    def __init__(self, json_mode: bool = False, *, stdout: TextIO | None = None, stderr: TextIO | None = None):
        self.json_mode = json_mode
        self._stdout = stdout if stdout is not None else sys.stdout
        self._stderr = stderr if stderr is not None else sys.stderr

    # The consoles are built on first use: Rich costs ~30 ms of start-up to import, and a --json run
    # only needs one for a warning.
    @cached_property
    def console(self) -> Console:
        """Rich console on stdout, for human renderings."""
        from rich.console import Console

        # soft_wrap: never break long keys or paths across lines in captured output.
        # Off a terminal Rich would wrap tables at 80 columns; files and pipes get wide lines instead.
        wide = None if self._stdout.isatty() else 160
        return Console(file=self._stdout, soft_wrap=True, highlight=False, width=wide)

    @cached_property
    def err(self) -> Console:
        """Rich console on stderr, for messages and progress bars."""
        from rich.console import Console

        return Console(file=self._stderr, soft_wrap=True, highlight=False)

    # -- results (stdout) ---------------------------------------------------------------------------
    def result(self, data: Any, human: Callable[[Console], None] | str | None = None) -> None:
        """The command's answer: ``data`` as one JSON document in JSON mode, else ``human`` rendered.

        ``human`` is a string or a function drawing on the stdout console; without it the data is
        printed as indented JSON, which is still readable.
        """
        if self.json_mode:
            self._write_json(data)
        elif callable(human):
            human(self.console)
        elif human is not None:
            self.console.print(human, markup=False)
        else:
            self.console.print_json(dumps(data))

    def record(self, data: Any, human: str | None = None) -> None:
        """One item of a stream: a JSON line in JSON mode, else ``human`` as one line (if given)."""
        if self.json_mode:
            self._write_json(data)
        elif human is not None:
            self.console.print(human, markup=False)

    def _write_json(self, data: Any) -> None:
        self._stdout.write(dumps(data) + "\n")
        self._stdout.flush()

    # -- messages (stderr) --------------------------------------------------------------------------
    def info(self, message: str) -> None:
        """A human message. Silent in JSON mode: machines read stdout and the exit code."""
        if not self.json_mode:
            self.err.print(message, markup=False)

    def warn(self, message: str) -> None:
        """A warning always reaches stderr, JSON mode included."""
        self.err.print(f"warning: {message}", markup=False, style="yellow")

    # -- progress (stderr, TTY only) ----------------------------------------------------------------
    @property
    def progress_enabled(self) -> bool:
        return not self.json_mode and self._stderr.isatty()

    @property
    def stderr_is_terminal(self) -> bool:
        return self._stderr.isatty()

    @contextmanager
    def progress(
        self,
        description: str,
        total: float | None = None,
        *,
        unit: str = "items",
        binary_units: bool = False,
        force: bool = False,
    ) -> Iterator[Any]:
        """A progress bar task with ``advance``/``update``; a no-op stand-in when bars are off.

        ``unit="bytes"`` shows sizes and transfer speed (``binary_units``: KiB, MiB, as lingctl's summaries
        write them); anything else shows done/total counts. ``force`` draws the bar even off a terminal or
        in JSON mode (stderr only), for a user who asked for it.
        """
        if not (self.progress_enabled or force):
            yield _NoProgress()
            return
        # Rich loads here, only when a bar is drawn.
        from rich.console import Console
        from rich.progress import Progress

        from lingctl.core.output_progress import progress_columns

        columns = progress_columns(unit, binary_units)
        console = self.err
        if force and not self._stderr.isatty():
            console = Console(file=self._stderr, soft_wrap=True, highlight=False, force_terminal=True)
        with Progress(*columns, console=console, transient=True) as bar:
            yield _Task(bar, bar.add_task(description, total=total))

    @contextmanager
    def stats_lines(self, interval: float, line: Callable[[], str]) -> Iterator[None]:
        """Write ``line()`` to stderr every ``interval`` seconds while the block runs, and once more at its
        end if the block outlasted one interval (so a log ends with the final figures). ``interval`` <= 0:
        nothing. Written whatever the JSON mode: stdout stays clean, and a batch job's log is stderr."""
        if interval <= 0:
            yield
            return
        stop = threading.Event()
        lock = threading.Lock()

        def emit() -> None:
            text = line()
            with lock:
                self._stderr.write(f"{time.strftime('%Y/%m/%d %H:%M:%S')} {text}\n")
                self._stderr.flush()

        def loop() -> None:
            while not stop.wait(interval):
                emit()

        started = time.monotonic()
        ticker = threading.Thread(target=loop, name="lingctl-stats", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            if time.monotonic() - started >= interval:
                emit()
