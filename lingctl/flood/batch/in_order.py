"""Answers written in the order of the batch file, whatever order they finish in.

An output in input order is the same file however the work was split: one engine or a cluster of them, in one go
or resumed after an interruption (a resumed run appends the rest, still in order). The cost is that an answer
finished before an earlier one waits in memory until that one is written; an interruption loses those waiting
answers, and ``--resume`` computes them again.
"""

from __future__ import annotations

from collections.abc import Callable


class InOrder:
    """Runs ``put(i, write)`` callbacks in the order of ``i`` = 0, 1, 2, ...: each as soon as all before it ran."""

    def __init__(self) -> None:
        self._next = 0
        self._waiting: dict[int, Callable[[], None]] = {}

    def put(self, index: int, write: Callable[[], None]) -> None:
        if index < self._next or index in self._waiting:
            raise ValueError(f"answer {index} was already given")
        self._waiting[index] = write
        while self._next in self._waiting:
            self._waiting.pop(self._next)()
            self._next += 1

    @property
    def waiting(self) -> int:
        """Answers finished but held back behind an earlier one."""
        return len(self._waiting)
