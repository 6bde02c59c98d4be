"""Scores over a training run: the per-checkpoint table (CSV and Markdown), one PNG of every task's curve, and
the checkpoints where a task's score fell by more than its noise.

Pure: scores in, files and lines out. matplotlib is imported only when a plot is asked for, with the Agg
backend (no display needed), as ``lingctl.train.plot`` does.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import UsageError
from lingctl.core.figures import FigureFormat, save_figure

METRICS = ("acc", "acc_norm")
TABLE_COLUMNS = (
    "step",
    "tokens",
    "task",
    "kind",
    "items",
    "acc",
    "acc_stderr",
    "acc_norm",
    "acc_norm_stderr",
    "flagged",
)


@dataclass(kw_only=True, slots=True)
class TaskScore:
    task: str
    kind: str  # "choice" or "generate"
    items: int
    acc: float
    acc_stderr: float  # sample std / sqrt(n), as lm-evaluation-harness reports it
    acc_norm: float | None = None  # choice tasks: argmax of per-character log-likelihood (lm-eval's acc_norm)
    acc_norm_stderr: float | None = None


@dataclass(kw_only=True, slots=True)
class CheckpointScores:
    step: int | None  # None for a plain model directory
    tokens: int | None  # training tokens consumed when the checkpoint was saved
    model: str  # path or id
    scores: dict[str, TaskScore]  # by task name


@dataclass(kw_only=True, slots=True)
class Drop:
    task: str
    metric: str  # "acc" or "acc_norm"
    step: int  # the checkpoint whose score fell
    previous_step: int
    before: float
    after: float
    threshold: float  # k * stderr: the fall had to exceed this to be flagged
    tokens_from: int | None  # training tokens consumed at previous_step ...
    tokens_to: int | None  # ... and at step: the training between the two checkpoints
    k: float = 0.0
    stderr: float = 0.0  # standard error of the difference, sqrt(se_before² + se_after²)


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation, n - 1 in the denominator, over
    sqrt(n)), as lm-evaluation-harness's ``mean_stderr``; the error is 0.0 for fewer than two values."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_stderr of no values")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def _metric(score: TaskScore, metric: str) -> tuple[float, float] | None:
    """(value, stderr) of ``metric`` in ``score``; None when the task has no such metric."""
    if metric == "acc":
        return score.acc, score.acc_stderr
    if metric == "acc_norm":
        if score.acc_norm is None:
            return None
        return score.acc_norm, score.acc_norm_stderr or 0.0
    raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")


def find_drops(points: Sequence[CheckpointScores], k: float, metric: str = "acc") -> list[Drop]:
    """The checkpoints where a task's ``metric`` fell by more than ``k`` standard errors since the previous
    checkpoint that scored the task (``points`` in training order; points without a step are skipped).

    The noise compared against is the standard error of the *difference* of two independent means,
    sqrt(se_prev² + se_cur²), not either checkpoint's own standard error: both scores are estimates from a
    finite item set, and their difference is noisier than either. So ``k = 2`` flags a fall that would be
    unlikely (about 2.3%, one-sided, under a normal approximation) if the two checkpoints were equally good.
    With ``k = 0`` every fall is flagged; an unchanged score never is.
    """
    if not math.isfinite(k) or k < 0:
        raise UsageError(f"the drop threshold must be a number of standard errors >= 0, got {k}")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    drops: list[Drop] = []
    previous: dict[str, tuple[int, int | None, float, float]] = {}  # task -> (step, tokens, value, stderr)
    for point in points:
        if point.step is None:
            continue
        for task, score in point.scores.items():
            current = _metric(score, metric)
            if current is None:
                continue
            after, se_after = current
            if task in previous:
                before_step, before_tokens, before, se_before = previous[task]
                stderr = math.sqrt(se_before**2 + se_after**2)
                threshold = k * stderr
                fall = before - after
                if fall > 0 and fall > threshold:
                    drops.append(
                        Drop(
                            task=task,
                            metric=metric,
                            step=point.step,
                            previous_step=before_step,
                            before=before,
                            after=after,
                            threshold=threshold,
                            tokens_from=before_tokens,
                            tokens_to=point.tokens,
                            k=k,
                            stderr=stderr,
                        )
                    )
            previous[task] = (point.step, point.tokens, after, se_after)
    return drops


def _tokens_range(drop: Drop) -> str:
    if drop.tokens_from is not None and drop.tokens_to is not None:
        return f": training tokens {drop.tokens_from:,}–{drop.tokens_to:,}"
    if drop.tokens_to is not None:
        return f": training tokens up to {drop.tokens_to:,}"
    return ""


def drop_line(drop: Drop, *, with_task: bool = True) -> str:
    """One drop in words: ``acc fell 0.62 → 0.41 (> 2.0 × se 0.07) between steps 40 and 60: training
    tokens 81,920–122,880``, after the task's name."""
    head = f"{drop.task}: " if with_task else ""
    return (
        f"{head}{drop.metric} fell {drop.before:.3g} → {drop.after:.3g} "
        f"(> {float(drop.k)} × se {drop.stderr:.2g}) between steps {drop.previous_step} and {drop.step}"
        f"{_tokens_range(drop)}"
    )


def drop_lines(drops: Sequence[Drop]) -> list[str]:
    """One human line per drop, in the order found."""
    return [drop_line(d) for d in drops]


def _flagged(drops: Sequence[Drop]) -> set[tuple[int, str]]:
    return {(d.step, d.task) for d in drops}


def _num(value: float | int | None) -> str:
    return "" if value is None else str(value)


def table_rows(points: Sequence[CheckpointScores], drops: Sequence[Drop]) -> list[dict[str, str]]:
    """One row per (checkpoint, task), the columns of ``TABLE_COLUMNS`` as text (blank for none)."""
    flagged = _flagged(drops)
    rows = []
    for point in points:
        for task, s in point.scores.items():
            rows.append(
                {
                    "step": _num(point.step),
                    "tokens": _num(point.tokens),
                    "task": task,
                    "kind": s.kind,
                    "items": str(s.items),
                    "acc": _num(s.acc),
                    "acc_stderr": _num(s.acc_stderr),
                    "acc_norm": _num(s.acc_norm),
                    "acc_norm_stderr": _num(s.acc_norm_stderr),
                    "flagged": "yes" if point.step is not None and (point.step, task) in flagged else "",
                }
            )
    return rows


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: a '|' would end the cell, a newline the row."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _with_stderr(value: float | None, stderr: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.3f} ± {stderr or 0.0:.3f}"


def markdown(points: Sequence[CheckpointScores], drops: Sequence[Drop]) -> str:
    """The table as Markdown: one row per (checkpoint, task), then the flagged drops in words."""
    flagged = _flagged(drops)
    lines = [
        "# Scores by checkpoint",
        "",
        "| step | training tokens | task | kind | items | acc | acc_norm | flagged |",
        "|---:|---:|---|---|---:|---|---|---|",
    ]
    for point in points:
        for task, s in point.scores.items():
            cells = [
                "" if point.step is None else str(point.step),
                "" if point.tokens is None else f"{point.tokens:,}",
                _cell(task),
                _cell(s.kind),
                str(s.items),
                _with_stderr(s.acc, s.acc_stderr),
                _with_stderr(s.acc_norm, s.acc_norm_stderr),
                "yes" if point.step is not None and (point.step, task) in flagged else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Flagged", ""]
    if drops:
        lines += [f"- **{_cell(d.task)}**: {_cell(drop_line(d, with_task=False))}" for d in drops]
    else:
        lines.append("No score fell by more than its threshold.")
    # A checkpoint of a run is named by its step; a plain model directory by its path.
    models = list(dict.fromkeys(p.model for p in points if p.step is None))
    if models:
        lines += ["", "Model: " + ", ".join(f"`{_cell(m)}`" for m in models)]
    return "\n".join(lines) + "\n"


def write_table(
    points: Sequence[CheckpointScores], drops: Sequence[Drop], csv_path: Path, md_path: Path
) -> tuple[Path, Path]:
    """Write the table as CSV (columns ``TABLE_COLUMNS``) and as Markdown, each atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=TABLE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(table_rows(points, drops))
    with atomic_write(Path(csv_path)) as (_, f):
        f.write(buffer.getvalue().encode())
    with atomic_write(Path(md_path)) as (_, f):
        f.write(markdown(points, drops).encode())
    return Path(csv_path), Path(md_path)


def _x_axis(points: Sequence[CheckpointScores]) -> tuple[list[float], str]:
    """Training tokens when every point has them, else steps, else the points' order."""
    if points and all(p.tokens is not None for p in points):
        return [float(p.tokens or 0) for p in points], "training tokens"
    if points and all(p.step is not None for p in points):
        return [float(p.step or 0) for p in points], "step"
    return [float(i) for i in range(len(points))], "checkpoint"


def plot_scores(
    points: Sequence[CheckpointScores], drops: Sequence[Drop], path: Path, *, fmt: FigureFormat = "png"
) -> Path:
    """One PNG (or ``fmt``) with a subplot per task: acc with its standard error as error bars, acc_norm dashed where the
    task has it, against training tokens (steps when a point lacks its tokens); flagged drops in red.
    Written atomically; ``UsageError`` when there are no scores. ``ImportError`` when matplotlib is missing."""
    tasks = list(dict.fromkeys(task for p in points for task in p.scores))
    if not tasks:
        raise UsageError("no scores to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, x_label = _x_axis(points)
    x_of = {id(p): x for p, x in zip(points, xs, strict=True)}
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    try:
        for i, ax in enumerate(axes.flat):
            if i < len(tasks):
                _plot_task(ax, tasks[i], points, drops, x_of, x_label)
            else:
                ax.set_visible(False)
        fig.tight_layout()
        return save_figure(fig, Path(path), fmt)
    finally:
        plt.close(fig)


def _accuracy_range(scores: Sequence[Any]) -> tuple[float, float]:
    """The y range of a task's panel: its scores and error bars, never past 0 or 1 (an accuracy axis with
    negative ticks, as matplotlib draws around all-zero scores, reads as nonsense), at least 0.05 tall."""
    values = [t.acc for t in scores] + [t.acc_norm for t in scores if t.acc_norm is not None]
    lows = [t.acc - t.acc_stderr for t in scores] + [min(values)]
    highs = [t.acc + t.acc_stderr for t in scores] + [max(values)]
    lo, hi = max(0.0, min(lows)), min(1.0, max(highs))
    pad = max(0.02, 0.1 * (hi - lo))
    lo, hi = max(0.0, lo - pad), min(1.0, hi + pad)
    if hi - lo < 0.05:
        lo, hi = (0.0, 0.05) if lo < 0.025 else (min(lo, 0.95), min(1.0, lo + 0.05))
    return lo, hi


def _plot_task(
    ax: Any,
    task: str,
    points: Sequence[CheckpointScores],
    drops: Sequence[Drop],
    x_of: dict[int, float],
    x_label: str,
) -> None:
    """One task's panel: acc with error bars, acc_norm dashed where the task has it, drops in red."""
    from matplotlib.ticker import EngFormatter

    at_step = {p.step: p for p in points if p.step is not None}
    scored = [p for p in points if task in p.scores]
    x = [x_of[id(p)] for p in scored]
    s = [p.scores[task] for p in scored]
    ax.errorbar(x, [t.acc for t in s], yerr=[t.acc_stderr for t in s], marker="o", capsize=3, label="acc")
    norm = [(xi, t) for xi, t in zip(x, s, strict=True) if t.acc_norm is not None]
    if norm:
        ax.errorbar(
            [xi for xi, _ in norm],
            [t.acc_norm for _, t in norm],
            yerr=[t.acc_norm_stderr or 0.0 for _, t in norm],
            marker="s",
            linestyle="--",
            capsize=3,
            label="acc_norm",
        )
    flagged = [(d, at_step[d.step]) for d in drops if d.task == task and d.step in at_step]
    if flagged:
        ax.plot(
            [x_of[id(p)] for _, p in flagged],
            [d.after for d, _ in flagged],
            linestyle="none",
            marker="v",
            markersize=11,
            color="red",
            label="drop",
            zorder=5,
        )
    ax.set_title(f"{task} ({s[-1].kind}, {s[-1].items} items)", fontsize=10)
    ax.set_xlabel(x_label)
    ax.set_ylabel("accuracy")
    ax.set_ylim(*_accuracy_range(s))
    if x_label == "training tokens":
        ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
