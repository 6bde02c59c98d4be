"""Regenerate the pictures in docs/images/ from one real lingctl run made here, in a temporary directory.

    python scripts/doc_pictures.py [--out docs/images]

1. `lingctl timer run -- lingctl train --preset tiny --nproc 2 ...`: a short two-worker training run on the
   built-in corpus, traced, with a checkpoint every 25 steps. `train-loss.svg` is its curves, drawn by the same
   function that draws `RUN/loss.png` (`lingctl.train.plot.plot_metrics`).
2. `lingctl flood eval` over that run's checkpoints on two small multiple-choice tasks written here from
   standard-library code (the order of a line's last words; how a line ends). `eval-scores.svg` is the run's
   `scores.png`, drawn by `lingctl.flood.eval.report.plot_scores` from the `scores.csv` the evaluation wrote.
3. `lingctl timer export` of the trace. `timer-timeline.svg` draws three training steps of the exported Chrome
   trace the way Perfetto lays one out: a lane per rank and track, slices as named bars, time in ms.

The library functions write PNG; here the figure is saved as SVG instead, with a fixed hash salt, text kept as
text and no date, so a picture changes only when its data does.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = 300
NPROC = 2  # workers: the timeline then shows two ranks and the collectives between them
SAVE_EVERY = 25  # twelve checkpoints: the scores picture shows the early rise, not only the plateau after it
EVAL_EVERY = 50
DROP_K = 2.0  # `flood eval --drop-k`: the scores picture marks the same drops the evaluation flagged
# Trace steps drawn on the timeline. The tracer counts steps from 0, so its step N ends at trainer step N + 1's
# optimizer step; these are clear of the eval and checkpoint that follow trainer step 150.
TIMELINE_STEPS = range(160, 163)


def lingctl(*args: str, env: dict[str, str]) -> None:
    """Run one lingctl command; its output is shown only when it fails."""
    cmd = [sys.executable, "-m", "lingctl", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        sys.exit(f"doc_pictures: 'lingctl {' '.join(args)}' exited with {done.returncode}")


def _code_lines() -> list[str]:
    """Lines of one standard-library module: the model is trained on the standard library, so it has seen
    code like this, and a task made from it measures what the model learned of how code reads."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    return [ln for ln in source.read_text().splitlines() if 24 <= len(ln.strip()) <= 70]


def _reorderings(words: list[str], rng: random.Random, n: int = 3) -> list[str] | None:
    """``n`` different orders of ``words`` other than the given one, joined as a line's rest; None when the words
    have too few orders (two words, or repeated ones)."""
    given, found = " " + " ".join(words), set()
    for _ in range(50):
        shuffled = rng.sample(words, len(words))
        found.add(" " + " ".join(shuffled))
        found.discard(given)
        if len(found) == n:
            return sorted(found)
    return None


def write_tasks(directory: Path, items: int = 80) -> list[Path]:
    """Two multiple-choice tasks, each item a few lines of code and the first part of the next as context:

    - ``word_order``: the rest of the line, against its words in three other orders. Same tokens, same length,
      so only the order tells them apart: the score rises from chance (0.25) as training goes on;
    - ``line_end``: the rest of the line, against the ends of three other lines of about the same length
      (so a summed log-likelihood is not a length contest): harder; in a short run it gains less.
    """
    lines = _code_lines()
    rng = random.Random(0)
    tasks: dict[str, list[tuple[str, str, str, list[str]]]] = {"word_order": [], "line_end": []}
    for i in rng.sample(range(3, len(lines)), len(lines) - 3):
        before, line = lines[i - 3 : i], lines[i]
        words, indent = line.split(), line[: len(line) - len(line.lstrip())]
        half = len(words) // 2
        others = _reorderings(words[half:], rng) if half >= 1 else None
        if others is not None and len(tasks["word_order"]) < items:
            head, rest = indent + " ".join(words[:half]), " " + " ".join(words[half:])
            tasks["word_order"].append((f"line{i}", "\n".join([*before, head]), rest, others))
        elif len(tasks["line_end"]) < items:
            cut = len(line) // 2
            ends = sorted({ln[len(ln) // 2 :] for ln in lines if abs(len(ln) - len(line)) <= 4} - {line[cut:]})
            tasks["line_end"].append((f"line{i}", "\n".join([*before, line[:cut]]), line[cut:], rng.sample(ends, 3)))
        if all(len(rows) == items for rows in tasks.values()):
            break
    paths = []
    for name, rows in tasks.items():
        path = directory / f"{name}.jsonl"
        with open(path, "w") as f:
            for item_id, context, right, wrong in rows:
                choices = [right, *wrong]
                rng.shuffle(choices)
                item = {"id": item_id, "context": context, "choices": choices, "answer": choices.index(right)}
                f.write(json.dumps(item) + "\n")
        paths.append(path)
    return paths


def loss_picture(run: Path, out: Path) -> Path:
    """The run's ``loss.png``, as SVG."""
    from lingctl.runs.layout import METRICS
    from lingctl.runs.records import read_records
    from lingctl.train.plot import plot_metrics

    title = f"lingctl train --preset tiny --nproc {NPROC} --steps {STEPS}"
    return plot_metrics(read_records(run / METRICS), out, title=title, fmt="svg")


def scores_picture(eval_dir: Path, out: Path) -> Path:
    """The evaluation's ``scores.png``, as SVG, from its ``scores.csv`` (the same scores, read back)."""
    from lingctl.flood.eval.report import CheckpointScores, TaskScore, find_drops, plot_scores
    from lingctl.flood.eval.run import TABLE_CSV

    def num(text: str) -> float | None:
        return float(text) if text else None

    points: dict[int, CheckpointScores] = {}
    with open(eval_dir / TABLE_CSV, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            point = points.setdefault(
                step, CheckpointScores(step=step, tokens=int(row["tokens"]), model=f"step {step}", scores={})
            )
            point.scores[row["task"]] = TaskScore(
                task=row["task"],
                kind=row["kind"],
                items=int(row["items"]),
                acc=float(row["acc"]),
                acc_stderr=float(row["acc_stderr"]),
                acc_norm=num(row["acc_norm"]),
                acc_norm_stderr=num(row["acc_norm_stderr"]),
            )
    ordered = [points[s] for s in sorted(points)]
    # The drops `flood eval` flagged, found again the way it finds them: on both metrics, with the same k.
    drops = [d for metric in ("acc", "acc_norm") for d in find_drops(ordered, DROP_K, metric=metric)]
    return plot_scores(ordered, drops, out, fmt="svg")


# Slice colours by the tracer's category; Perfetto hashes slice names instead, which for a few kinds reads worse.
CATEGORY_COLOURS = {
    "step": "#9fb4c7",
    "forward": "#4c8bf5",
    "backward": "#f4a340",
    "optimizer": "#54b36a",
    "collective": "#d9534f",
    "p2p": "#a86fd1",
    "data": "#8c8c8c",
    "copy": "#c7a26b",
}


def _lanes(events: list[dict[str, Any]]) -> list[tuple[str, list[tuple[int, dict[str, Any]]]]]:
    """(label, [(depth, slice)]) per lane: one lane per (process, thread) track that has slices, in Perfetto's
    order (process sort index, then thread id). A slice inside another is drawn one row down, as Perfetto nests
    them."""
    names: dict[tuple[int, int | None], str] = {}
    sort_index: dict[int, int] = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "process_sort_index":
            sort_index[e["pid"]] = e["args"]["sort_index"]
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    lanes = []
    for pid, tid in sorted(by_track, key=lambda k: (sort_index.get(k[0], k[0]), k[1])):
        stack: list[float] = []  # end times of the open enclosing slices
        placed = []
        for e in sorted(by_track[(pid, tid)], key=lambda e: (e["ts"], -e["dur"])):
            # A slice that starts where the last one ended is its successor, not its child: the exported end
            # (ts + dur) can exceed the next start by a float rounding.
            while stack and stack[-1] <= e["ts"] + 0.01:
                stack.pop()
            placed.append((len(stack), e))
            stack.append(e["ts"] + e["dur"])
        # The process is named by its rank only: the pid in the exported name changes with every run.
        lanes.append((f"rank {pid}  {names.get((pid, tid), f'thread {tid}')}", placed))
    return lanes


def _fit(name: str, chars: int) -> str:
    """``name`` cut to ``chars`` characters with an ellipsis, as Perfetto labels a narrow slice; "" when not
    even three characters fit."""
    if len(name) <= chars:
        return name
    return name[: chars - 1] + "…" if chars >= 4 else ""


def timeline_picture(trace: Path, out: Path) -> Path:
    """Draw ``TIMELINE_STEPS`` of an exported Chrome trace: every track of every rank as a lane, time in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from lingctl.core.figures import save_figure

    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e.get("cat") == "step" and e["args"]["step"] in TIMELINE_STEPS]
    if not steps:
        sys.exit(f"doc_pictures: {trace} has no steps {TIMELINE_STEPS.start}-{TIMELINE_STEPS.stop - 1}")
    t0 = min(e["ts"] for e in steps)
    t1 = max(e["ts"] + e["dur"] for e in steps)
    window = [e for e in events if e["ph"] == "M" or (e["ph"] == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0)]
    lanes = _lanes(window)
    span_ms = (t1 - t0) / 1000

    width_in, row_in = 9.0, 0.32
    rows = sum(1 + max(d for d, _ in placed) for _, placed in lanes)
    fig, ax = plt.subplots(figsize=(width_in, 1.2 + row_in * rows))
    try:
        # Roughly how many ms one character of 7-pt text covers: a name is written only where it fits.
        ms_per_char = span_ms / (width_in * 0.8 * 72 / 4.2)
        y, ticks, labels = 0.0, [], []
        seen: dict[str, str] = {}  # category -> colour, for the legend
        for label, placed in lanes:
            depth = max(d for d, _ in placed)
            ticks.append(y + depth / 2)
            labels.append(label)
            for d, e in placed:
                start = round(max(e["ts"], t0) / 1000 - t0 / 1000, 3)
                end = round(min(e["ts"] + e["dur"], t1) / 1000 - t0 / 1000, 3)
                colour = CATEGORY_COLOURS.get(e.get("cat", ""), "#bbbbbb")
                ax.barh(y + d, end - start, left=start, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
                name = _fit(e["name"], int((end - start) / ms_per_char) - 1)
                if name:
                    ax.text((start + end) / 2, y + d, name, ha="center", va="center", fontsize=7)
                seen[e.get("cat", "")] = colour
            y += depth + 1.3
        ax.set_yticks(ticks, labels, fontsize=8)
        ax.set_ylim(y - 0.8, -0.7)  # first lane on top, as in Perfetto
        ax.set_xlim(0, span_ms)
        ax.set_xlabel(f"ms from the start of trace step {TIMELINE_STEPS.start}")
        # Perfetto has no legend; here the colours stand for the slices too short to carry their name.
        handles = [Patch(color=c, label=cat) for cat, c in seen.items()]
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(axis="y", length=0)
        first, last = TIMELINE_STEPS.start, TIMELINE_STEPS.stop - 1
        ax.set_title(f"lingctl timer export: trace steps {first}-{last} of {NPROC} ranks", fontsize=10)
        fig.tight_layout(rect=(0, 0.1, 1, 1))  # the bottom tenth holds the legend
        save_figure(fig, out, "svg")
    finally:
        plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"), help="where the SVGs go (docs/images)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # One intra-op thread per process: on a small machine shared with other work, torch's spinning worker
    # threads can make a tiny step many times slower, and two workers already fill two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lingctl-doc-pictures-") as tmp:
        work = Path(tmp)
        traces, run = work / "traces", work / "run"
        lingctl(
            "timer", "run", "--out", str(traces), "--",
            sys.executable, "-m", "lingctl", "train", "--preset", "tiny", "--nproc", str(NPROC), "--steps", str(STEPS),
            "--eval-every", str(EVAL_EVERY), "--save-every", str(SAVE_EVERY),
            "--set", f"keep_checkpoints={STEPS // SAVE_EVERY}",  # all of them, for flood eval
            "--out", str(run),
            env=env,
        )  # fmt: skip
        tasks = [str(p) for p in write_tasks(work)]
        eval_dir = work / "run.eval"
        lingctl("flood", "eval", *tasks, "--model", str(run), "-o", str(eval_dir), "--drop-k", str(DROP_K), env=env)
        trace = work / "trace.json"
        lingctl("timer", "export", str(traces), "-o", str(trace), env=env)

        written = [
            loss_picture(run, args.out / "train-loss.svg"),
            scores_picture(eval_dir, args.out / "eval-scores.svg"),
            timeline_picture(trace, args.out / "timer-timeline.svg"),
        ]
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1024:.1f} KiB)")
    print(f"in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
