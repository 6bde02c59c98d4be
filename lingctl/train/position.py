"""Where a worker's data stream is: the sequences it has consumed, and the batches that spiked, waiting to be
retried (Ling report §3: a spiking batch is skipped and its data retried later, once).

The batch order is a pure function of (seed, position) (``data.BatchOrder``), so a position is all a checkpoint
needs to resume the stream exactly; worker ``rank`` of ``world`` reads its own stride of it (``strided_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lingctl.runs.train_config import SpikeConfig
from lingctl.train.data import Order
from lingctl.train.workers import Workers, strided_rows


@dataclass(slots=True)
class Retry:
    due: int  # the step from which it is retried
    rows: list[int]
    tries: int  # how often these rows were tried before


@dataclass(slots=True)
class DataPosition:
    cursor: int = 0  # sequences of this worker's stride consumed so far
    retries: list[Retry] = field(default_factory=list)  # by due step

    def next_batch(self, step: int, size: int, order: Order, workers: Workers) -> tuple[list[int], int]:
        """Rows for the attempt at ``step`` and how often they were tried before: a due retry first, else
        ``size`` fresh rows."""
        if self.retries and self.retries[0].due <= step:
            r = self.retries.pop(0)
            return r.rows, r.tries
        rows = strided_rows(order.indices, self.cursor, size, workers.rank, workers.world)
        self.cursor += size
        return rows, 0

    def put_back(self, rows: list[int], tries: int, step: int, spike: SpikeConfig) -> int | None:
        """A batch that spiked at ``step``: the step it is retried at, or None when it is dropped (it was
        retried as often as ``spike.max_retries`` allows)."""
        if tries >= spike.max_retries:
            return None
        due = step + spike.retry_after_steps
        self.retries.append(Retry(due, rows, tries + 1))
        self.retries.sort(key=lambda r: r.due)
        return due

    def skip_to(self, cursor: int, world: int) -> list[int]:
        """Go on from ``cursor`` at least (a rollback skips the data that diverged); the skipped window, in
        positions of the run's batch order."""
        window = [self.cursor * world, cursor * world]
        self.cursor = max(self.cursor, cursor)
        return window

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "retries": [{"due": r.due, "rows": r.rows, "tries": r.tries} for r in self.retries],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DataPosition:
        return cls(state["cursor"], [Retry(**r) for r in state["retries"]])
