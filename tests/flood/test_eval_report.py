"""Scores over a run: standard errors, drops beyond the noise, the CSV/Markdown table and the PNG."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from lingctl.core.atomic import TMP_MARKER
from lingctl.core.errors import UsageError
from lingctl.flood.eval.report import (
    TABLE_COLUMNS,
    CheckpointScores,
    TaskScore,
    drop_lines,
    find_drops,
    mean_stderr,
    plot_scores,
    write_table,
)

TOKENS_PER_STEP = 2048


def choice(acc: float, se: float = 0.05, norm: float | None = None, norm_se: float = 0.05) -> TaskScore:
    return TaskScore(
        task="arc",
        kind="choice",
        items=50,
        acc=acc,
        acc_stderr=se,
        acc_norm=norm,
        acc_norm_stderr=None if norm is None else norm_se,
    )


def generate(acc: float, se: float = 0.05) -> TaskScore:
    return TaskScore(task="sums", kind="generate", items=40, acc=acc, acc_stderr=se)


def point(step: int, tokens: int | None = -1, **scores: TaskScore) -> CheckpointScores:
    return CheckpointScores(
        step=step,
        tokens=step * TOKENS_PER_STEP if tokens == -1 else tokens,
        model=f"run/checkpoints/step-{step:08d}",
        scores=scores,
    )


def test_mean_stderr_is_the_sample_std_over_sqrt_n() -> None:
    mean, se = mean_stderr([1.0, 0.0, 1.0, 1.0])
    # Sample variance: (3 * 0.25² + 0.75²) / 3 = 0.25; se = sqrt(0.25 / 4).
    assert mean == 0.75 and se == pytest.approx(0.25)
    assert mean_stderr([0.5]) == (0.5, 0.0)
    assert mean_stderr([1.0, 1.0, 1.0]) == (1.0, 0.0)
    with pytest.raises(ValueError):
        mean_stderr([])


def test_with_k_0_every_fall_is_flagged_but_an_unchanged_score_is_not() -> None:
    points = [
        point(20, arc=choice(0.50)),
        point(40, arc=choice(0.49)),  # fell 0.01
        point(60, arc=choice(0.49)),  # unchanged
        point(80, arc=choice(0.60)),  # rose
        point(100, arc=choice(0.30)),  # fell 0.30
    ]
    drops = find_drops(points, 0.0)
    assert [(d.previous_step, d.step) for d in drops] == [(20, 40), (80, 100)]
    assert all(d.threshold == 0.0 and d.task == "arc" and d.metric == "acc" for d in drops)
    assert (drops[1].before, drops[1].after) == (0.60, 0.30)


def test_with_k_2_only_a_fall_beyond_twice_the_stderr_of_the_difference_is_flagged() -> None:
    # se 0.05 at both checkpoints: the difference has se sqrt(2) * 0.05 = 0.0707, so k = 2 needs > 0.141.
    points = [
        point(20, arc=choice(0.70), sums=generate(0.50)),
        point(40, arc=choice(0.58), sums=generate(0.30)),  # arc fell 0.12 (noise), sums 0.20 (a drop)
        point(60, arc=choice(0.62), sums=generate(0.31)),
        point(80, arc=choice(0.41), sums=generate(0.31)),  # arc fell 0.21: a drop
    ]
    drops = find_drops(points, 2.0)
    assert [(d.task, d.previous_step, d.step) for d in drops] == [("sums", 20, 40), ("arc", 60, 80)]
    arc = drops[1]
    assert arc.threshold == pytest.approx(2 * math.sqrt(2) * 0.05) and arc.stderr == pytest.approx(0.0707, abs=1e-4)
    # The training between the two checkpoints, in tokens.
    assert (arc.tokens_from, arc.tokens_to) == (60 * TOKENS_PER_STEP, 80 * TOKENS_PER_STEP) == (122_880, 163_840)
    # A wider error at one checkpoint widens the threshold: the same fall is then within the noise.
    noisy = [point(60, arc=choice(0.62, se=0.10)), point(80, arc=choice(0.41, se=0.10))]
    assert find_drops(noisy, 2.0) == []


def test_acc_norm_drops_and_tasks_missing_at_a_checkpoint() -> None:
    points = [
        point(10, arc=choice(0.5, norm=0.60)),
        point(20, sums=generate(0.4)),  # arc not scored here: compared with step 10
        point(30, arc=choice(0.5, norm=0.20), sums=generate(0.4)),
        CheckpointScores(step=None, tokens=None, model="other", scores={"arc": choice(0.0, norm=0.0)}),
    ]
    assert find_drops(points, 2.0) == []  # acc did not move
    (drop,) = find_drops(points, 2.0, metric="acc_norm")
    assert (drop.task, drop.previous_step, drop.step, drop.before, drop.after) == ("arc", 10, 30, 0.60, 0.20)
    assert find_drops(points, 2.0, metric="acc_norm")[0].tokens_from == 10 * TOKENS_PER_STEP
    with pytest.raises(UsageError):
        find_drops(points, -1.0)
    with pytest.raises(ValueError):
        find_drops(points, 1.0, metric="f1")


def test_drop_lines_say_what_fell_by_how_much_and_over_which_tokens() -> None:
    points = [point(40, tokens=81_920, arc=choice(0.62)), point(60, tokens=122_880, arc=choice(0.41))]
    assert drop_lines(find_drops(points, 2.0)) == [
        "arc: acc fell 0.62 → 0.41 (> 2.0 × se 0.071) between steps 40 and 60: training tokens 81,920–122,880"
    ]
    unknown = [point(40, tokens=None, arc=choice(0.62)), point(60, tokens=None, arc=choice(0.41))]
    assert drop_lines(find_drops(unknown, 2.0)) == [
        "arc: acc fell 0.62 → 0.41 (> 2.0 × se 0.071) between steps 40 and 60"
    ]


def _points() -> list[CheckpointScores]:
    return [
        point(40, arc=choice(0.62, norm=0.66), sums=generate(0.25)),
        point(60, arc=choice(0.41, norm=0.40), sums=generate(0.30)),
    ]


def test_write_table_writes_one_row_per_checkpoint_and_task_and_notes_the_drops(tmp_path: Path) -> None:
    points = _points()
    drops = find_drops(points, 2.0)
    csv_path, md_path = write_table(points, drops, tmp_path / "scores.csv", tmp_path / "scores.md")
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames or ()) == TABLE_COLUMNS
    assert [(r["step"], r["tokens"], r["task"], r["flagged"]) for r in rows] == [
        ("40", "81920", "arc", ""),
        ("40", "81920", "sums", ""),
        ("60", "122880", "arc", "yes"),
        ("60", "122880", "sums", ""),
    ]
    arc60 = rows[2]
    assert (arc60["kind"], arc60["items"], float(arc60["acc"]), float(arc60["acc_norm"])) == (
        "choice",
        "50",
        0.41,
        0.40,
    )
    assert rows[1]["acc_norm"] == "" and rows[1]["acc_norm_stderr"] == "" and rows[1]["kind"] == "generate"

    md = md_path.read_text()
    assert "| 60 | 122,880 | arc | choice | 50 | 0.410 ± 0.050 | 0.400 ± 0.050 | yes |" in md
    assert "| 40 | 81,920 | sums | generate | 40 | 0.250 ± 0.050 |  |  |" in md
    assert (
        "- **arc**: acc fell 0.62 → 0.41 (> 2.0 × se 0.071) between steps 40 and 60: training tokens 81,920–122,880"
    ) in md
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]

    write_table(points, [], csv_path, md_path)  # replaced whole
    assert "yes" not in csv_path.read_text() and "No score fell" in md_path.read_text()


def test_accuracy_axes_never_go_below_zero_or_above_one() -> None:
    from lingctl.flood.eval.report import _accuracy_range

    assert _accuracy_range([generate(0.0, se=0.0), generate(0.0, se=0.0)]) == (0.0, 0.05)  # all zero: no negative ticks
    assert _accuracy_range([generate(0.0), generate(0.0)])[0] == 0.0  # error bars below 0 are cut at 0
    assert _accuracy_range([choice(1.0, norm=1.0)])[1] == 1.0
    lo, hi = _accuracy_range([choice(0.40, norm=0.42), choice(0.45, norm=0.47)])
    assert 0.0 < lo < 0.40 and 0.47 < hi < 1.0  # a tight range keeps its detail


def test_plot_scores_writes_a_png_matplotlib_reads_back(tmp_path: Path) -> None:
    import matplotlib.image

    points = _points() + [point(80, arc=choice(0.7, norm=0.7), sums=generate(0.31))]
    out = plot_scores(points, find_drops(points, 2.0), tmp_path / "scores.png")
    assert out == tmp_path / "scores.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 2 * image.shape[0]  # two panels side by side
    # Without token counts the x axis falls back to steps; a lone plain model directory still plots.
    steps_only = [point(40, tokens=None, sums=generate(0.2)), point(60, tokens=None, sums=generate(0.1))]
    assert plot_scores(steps_only, find_drops(steps_only, 0.0), tmp_path / "steps.png").read_bytes()[:4] == b"\x89PNG"
    single = [CheckpointScores(step=None, tokens=None, model="m", scores={"sums": generate(0.5)})]
    assert matplotlib.image.imread(plot_scores(single, [], tmp_path / "one.png")).ndim == 3
    assert b"<svg" in plot_scores(points, [], tmp_path / "scores.svg", fmt="svg").read_bytes()[:500]
    assert not [p for p in tmp_path.iterdir() if TMP_MARKER in p.name]
    with pytest.raises(UsageError, match="no scores"):
        plot_scores([], [], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
