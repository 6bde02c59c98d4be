"""A long job's progress as the output layer shows it: a Rich bar on a terminal; off a terminal one status line
on stderr every few seconds, so a batch job's log shows progress; nothing with --json (the summary is the
answer). The one live view of every command (flood, flood eval, train)."""

from __future__ import annotations

import time
from typing import Any

from lingctl.core.output import Output

EVERY_S = 5.0  # off a terminal, one status line per this many seconds


class StatusView:
    def __init__(self, out: Output, *, every_s: float = EVERY_S) -> None:
        self.out = out
        self.every_s = every_s
        self._cm: Any = None
        self._task: Any = None
        self._name: str | None = None
        self._last = time.monotonic()

    def __enter__(self) -> StatusView:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(*exc)

    def _close(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*(exc or (None, None, None)))
            self._cm = None

    def show(self, name: str, text: str, *, completed: float, total: float | None, line: str | None = None) -> None:
        """``text`` on the bar called ``name`` (a new name starts a new bar); off a terminal ``line`` (default:
        ``text``) once every ``every_s``."""
        self.update(name, text, completed=completed, total=total)
        self.log(line if line is not None else text)

    def update(self, name: str, text: str, *, completed: float, total: float | None) -> None:
        """The bar alone: ``text`` on the bar called ``name`` (a new name starts a new bar)."""
        if name != self._name:
            self._close()
            self._name = name
            self._cm = self.out.progress(name, total=total)
            self._task = self._cm.__enter__()
        self._task.update(description=text, completed=completed)

    def log(self, line: str, *, now: bool = False) -> None:
        """Off a terminal, ``line`` on stderr when ``every_s`` has passed since the last one (``now``: at once,
        for the lines a log must have, as the first and the last)."""
        if self.out.progress_enabled or not (now or time.monotonic() - self._last >= self.every_s):
            return
        self._last = time.monotonic()
        self.out.info(line)
