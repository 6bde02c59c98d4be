"""The Rich columns of ``Output.progress`` bars, apart so that Rich loads only when a bar is drawn."""

from __future__ import annotations

from typing import Any

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from lingctl.core.units import format_size


class _BinarySpeedColumn(ProgressColumn):
    """Transfer speed in KiB/s, MiB/s (Rich's own column has only decimal units)."""

    def render(self, task: Any) -> Text:
        speed = task.finished_speed or task.speed
        return Text("?" if speed is None else f"{format_size(speed)}/s", style="progress.data.speed")


def progress_columns(unit: str, binary_units: bool) -> list[ProgressColumn]:
    """Sizes and speed for ``unit="bytes"``, done/total counts for anything else."""
    if unit == "bytes":
        speed = _BinarySpeedColumn() if binary_units else TransferSpeedColumn()
        return [
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=binary_units),
            speed,
            TimeRemainingColumn(),
        ]
    return [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
    ]
