"""A run's curves as one PNG, from its metrics.jsonl (records read by ``metrics_file.read_records``): loss (and
eval loss), learning rate, expert load.

matplotlib is imported only here, with the Agg backend (no display needed), when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lingctl.core.errors import UsageError
from lingctl.core.figures import FigureFormat, save_figure
from lingctl.runs.layout import PLOT as PLOT_FILE  # noqa: F401  (re-exported: the run's default plot)


def plot_metrics(records: list[dict[str, Any]], out: Path, *, title: str = "", fmt: FigureFormat = "png") -> Path:
    """Write the curves of ``records`` to ``out`` as a PNG (or ``fmt``), atomically; ``UsageError`` without step records.
    ``ImportError`` when matplotlib is missing."""
    steps = [r for r in records if r.get("event") == "step"]
    if not steps:
        raise UsageError(f"no training steps to plot{f' in {title}' if title else ''}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["step"] for r in steps]
    evals = [r for r in records if r.get("event") == "eval"]
    fig, (ax_loss, ax_lr, ax_load) = plt.subplots(3, 1, sharex=True, figsize=(8, 8))
    try:
        ax_loss.plot(x, [r["loss"] for r in steps], label="train loss", linewidth=1)
        if evals:
            ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        ax_loss.set_ylabel("loss")
        ax_loss.legend()
        ax_lr.plot(x, [r["lr"] for r in steps], color="tab:green", linewidth=1)
        ax_lr.set_ylabel("learning rate")
        # The worst-balanced MoE layer per step: the coefficient of variation of its per-expert token counts.
        ax_load.plot(
            x,
            [max((layer["cv"] for layer in r.get("expert_load") or []), default=0.0) for r in steps],
            color="tab:red",
            linewidth=1,
        )
        ax_load.set_ylabel("expert load cv (max over layers)")
        ax_load.set_xlabel("step")
        for ax in (ax_loss, ax_lr, ax_load):
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return save_figure(fig, Path(out), fmt)
    finally:
        plt.close(fig)
