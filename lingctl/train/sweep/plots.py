"""A sweep's fit as pictures and as the table ``lingctl train fit`` prints. matplotlib is imported only when a
picture is drawn (Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lingctl.core.figures import save_figure
from lingctl.train.sweep.laws import PointResult, PowerLaw


def fit_table(fit: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for family, fam in fit["families"].items():
        lines.append(f"{family}:")
        for b in fam["budgets"]:
            best = b["best"]
            lines.append(
                f"  C = {b['compute']:.3g}: best loss {b['best_loss']:.4f} at lr {best['lr']:.3g}, batch {best['batch_size']}"
                f" ({len(b['near_optimal'])} of {b['points']} runs within {100 * fit['tolerance']:.2g}%)"
            )
        for key, name in (("lr_law", "lr_opt"), ("batch_law", "B_opt"), ("loss_law", "loss")):
            if fam[key]:
                lines.append("  " + PowerLaw.from_json(fam[key]).text(name))
    for row in fit["lever"]:
        lines.append(
            f"lever at C = {row['compute']:.3g}: dense needs {row['lever']:.2f}x the compute for MoE's loss {row['moe_loss']:.4f}"
        )
    lines += [f"note: {n}" for n in fit.get("notes", [])]
    return lines


def plot_fit(fit: dict[str, Any], points: Sequence[PointResult], out_dir: Path) -> list[Path]:
    """``lr_loss.png``, ``laws.png`` and ``loss_compute.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fams = fit["families"]
    # Loss against learning rate per budget (the best batch size of each lr), the optimum marked.
    fig, axes = plt.subplots(1, len(fams), figsize=(6 * len(fams), 4.5), squeeze=False)
    for ax, (family, fam) in zip(axes[0], fams.items()):
        for b in fam["budgets"]:
            mine = [p for p in points if p.family == family and abs(p.compute - b["compute"]) <= 0.02 * b["compute"]]
            lrs = sorted({p.lr for p in mine})
            best = [min(p.loss for p in mine if p.lr == lr) for lr in lrs]
            (line,) = ax.plot(lrs, best, "o-", label=f"C = {b['compute']:.2g}")
            ax.plot([b["best"]["lr"]], [b["best_loss"]], "*", markersize=14, color=line.get_color())
        ax.set_xscale("log")
        ax.set(xlabel="learning rate", ylabel="eval loss (best batch size)", title=family)
        ax.legend(fontsize=8)
    written.append(save_figure(fig, out_dir / "lr_loss.png"))
    plt.close(fig)

    fig, (ax_lr, ax_b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for family, fam in fams.items():
        for ax, key, law_key in ((ax_lr, "lr", "lr_law"), (ax_b, "batch_size", "batch_law")):
            xs = [b["compute"] for b in fam["budgets"] for _ in b["near_optimal"]]
            ys = [n[key] for b in fam["budgets"] for n in b["near_optimal"]]
            (dots,) = ax.plot(xs, ys, "o", alpha=0.6, label=f"{family} near-optimal")
            if fam[law_key]:
                law = PowerLaw.from_json(fam[law_key])
                grid = np.geomspace(law.x_min, law.x_max, 20)
                ax.plot(grid, [law(c) for c in grid], "-", color=dots.get_color(),
                        label=f"{family}: b = {law.exponent:.3f} ± {law.exponent_stderr:.3f}")  # fmt: skip
    for ax, name in ((ax_lr, "learning rate"), (ax_b, "batch size (sequences)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="compute (FLOPs)", ylabel=name)
        ax.legend(fontsize=8)
    written.append(save_figure(fig, out_dir / "laws.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for family, fam in fams.items():
        cs = [b["compute"] for b in fam["budgets"]]
        (dots,) = ax.plot(cs, [b["best_loss"] for b in fam["budgets"]], "o", label=f"{family} best")
        if fam["loss_law"]:
            law = PowerLaw.from_json(fam["loss_law"])
            grid = np.geomspace(min(cs), max(cs), 20)
            ax.plot(
                grid, [law(c) for c in grid], "-", color=dots.get_color(), label=f"{family}: b = {law.exponent:.4f}"
            )
    ax.set_xscale("log")
    ax.set(xlabel="compute (FLOPs)", ylabel="eval loss")
    if fit["lever"]:
        ax.set_title("lever: " + ", ".join(f"{r['lever']:.2f}x" for r in fit["lever"]))
    ax.legend(fontsize=8)
    written.append(save_figure(fig, out_dir / "loss_compute.png"))
    plt.close(fig)
    return written
