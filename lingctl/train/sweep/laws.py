"""Scaling laws fitted from a sweep's results (numpy only).

The method of DeepSeek LLM §3.1, which the Ling report's §3.3 follows: for each compute budget, the runs whose
eval loss is within a tolerance (0.25%) of that budget's best form the near-optimal region, and the learning rate
and batch size laws ``lr_opt = a * C^b``, ``B_opt = a * C^b`` are fitted by least squares in log-log space over all
near-optimal points of all budgets. The best loss per budget gives ``L(C) = a * C^b`` per model family, and with a
MoE and a dense family the efficiency lever at a budget C is ``C_dense(L_moe(C)) / C``: how much more compute
the dense family needs for the MoE family's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lingctl.core.errors import UsageError

FORMAT = "lingctl-sweep-fit"


@dataclass(kw_only=True, slots=True)
class PointResult:
    family: str  # "moe" or "dense"
    compute: float  # FLOPs: the point's budget (6 x active parameters x tokens, within 5%)
    lr: float
    batch_size: int  # sequences per step
    tokens: int
    active_parameters: int
    loss: float  # final eval loss


@dataclass(kw_only=True, slots=True)
class PowerLaw:
    """``y = coef * x^exponent``, fitted in log space; standard errors from ordinary least squares."""

    coef: float
    exponent: float
    exponent_stderr: float  # nan with fewer than 3 points
    log_coef_stderr: float
    r2: float
    n: int
    x_min: float
    x_max: float

    def __call__(self, x: float) -> float:
        return self.coef * x**self.exponent

    def text(self, name: str) -> str:
        return (
            f"{name} = {self.coef:.4g} * C^{self.exponent:.4f} (exponent ± {self.exponent_stderr:.4f}, "
            f"R² = {self.r2:.3f}, {self.n} points)"
        )

    def to_json(self) -> dict[str, Any]:
        return {k: _finite(getattr(self, k)) for k in _FIELDS}

    @staticmethod
    def from_json(d: dict[str, Any]) -> PowerLaw:
        values: dict[str, Any] = {k: (math.nan if d[k] is None else d[k]) for k in _FIELDS}
        return PowerLaw(**values)


_FIELDS = ("coef", "exponent", "exponent_stderr", "log_coef_stderr", "r2", "n", "x_min", "x_max")


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> PowerLaw:
    """Least squares of ln y on ln x."""
    lx, ly = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    if not (np.isfinite(lx).all() and np.isfinite(ly).all()):
        raise ValueError("a power law needs positive values")
    if len(set(lx.tolist())) < 2:
        raise ValueError("a power law needs points at two different budgets at least")
    n = len(lx)
    design = np.stack([np.ones(n), lx], axis=1)
    beta, *_ = np.linalg.lstsq(design, ly, rcond=None)
    resid = ly - design @ beta
    ss_res = float(resid @ resid)
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    if n > 2:
        cov = ss_res / (n - 2) * np.linalg.inv(design.T @ design)
        se_a, se_b = math.sqrt(cov[0, 0]), math.sqrt(cov[1, 1])
    else:
        se_a = se_b = math.nan
    return PowerLaw(
        coef=math.exp(beta[0]),
        exponent=float(beta[1]),
        exponent_stderr=se_b,
        log_coef_stderr=se_a,
        r2=r2,
        n=n,
        x_min=float(np.exp(lx.min())),
        x_max=float(np.exp(lx.max())),
    )


def _budgets(points: list[PointResult], tolerance: float) -> list[dict[str, Any]]:
    """Per budget (computes within 5% of each other are one budget): the best run and the near-optimal ones."""
    groups: dict[float, list[PointResult]] = {}
    for p in sorted(points, key=lambda p: p.compute):
        key = next((k for k in groups if abs(p.compute - k) <= 0.05 * k), p.compute)
        groups.setdefault(key, []).append(p)
    out = []
    for members in groups.values():
        compute = float(np.exp(np.mean(np.log([p.compute for p in members]))))
        best = min(members, key=lambda p: p.loss)
        near = [p for p in members if p.loss <= best.loss * (1 + tolerance)]
        out.append(
            {
                "compute": compute,
                "best_loss": best.loss,
                "best": {"lr": best.lr, "batch_size": best.batch_size},
                "near_optimal": [{"lr": p.lr, "batch_size": p.batch_size, "loss": p.loss} for p in near],
                "points": len(members),
            }
        )
    return out


def _law(x: list[float], y: list[float], what: str, notes: list[str]) -> dict[str, Any] | None:
    try:
        return fit_power_law(x, y).to_json()
    except ValueError as exc:
        notes.append(f"{what}: not fitted ({exc})")
        return None


def fit_sweep(points: Sequence[PointResult], *, tolerance: float = 0.0025) -> dict[str, Any]:
    """The fit.json document: per family the budgets with their near-optimal regions and the three laws, and the
    MoE-vs-dense lever when both families are there."""
    notes: list[str] = []
    good = [p for p in points if math.isfinite(p.loss)]
    if len(good) < len(points):
        notes.append(f"{len(points) - len(good)} point(s) without a finite eval loss left out")
    families: dict[str, Any] = {}
    for family in sorted({p.family for p in good}):
        budgets = _budgets([p for p in good if p.family == family], tolerance)
        near = [(b["compute"], n) for b in budgets for n in b["near_optimal"]]
        families[family] = {
            "budgets": budgets,
            "lr_law": _law([c for c, _ in near], [n["lr"] for _, n in near], f"{family} lr_opt", notes),
            "batch_law": _law([c for c, _ in near], [n["batch_size"] for _, n in near], f"{family} B_opt", notes),
            "loss_law": _law(
                [b["compute"] for b in budgets], [b["best_loss"] for b in budgets], f"{family} loss", notes
            ),
        }
    lever = []
    if {"moe", "dense"} <= families.keys() and families["moe"]["loss_law"] and families["dense"]["loss_law"]:
        dense = PowerLaw.from_json(families["dense"]["loss_law"])
        for b in families["moe"]["budgets"]:
            loss = b["best_loss"]
            needed = (loss / dense.coef) ** (1 / dense.exponent) if dense.exponent != 0 else math.nan
            lever.append(
                {"compute": b["compute"], "moe_loss": loss, "dense_compute": needed, "lever": needed / b["compute"]}
            )
    return {
        "format": FORMAT,
        "version": 1,
        "tolerance": tolerance,
        "families": families,
        "lever": lever,
        "default_family": "moe" if "moe" in families else next(iter(families), None),
        "notes": notes,
    }


def predict(fit: dict[str, Any], budget: float, *, family: str | None = None) -> dict[str, Any]:
    """The learning rate and batch size the laws give at ``budget``, how far outside the fitted budgets it is,
    and an approximate 1-sigma range from the exponents' standard errors (around the fitted range's log-centre)."""
    family = family or fit.get("default_family")
    fam = fit.get("families", {}).get(family)
    if fam is None:
        raise UsageError(f"the fit has no family {family!r}", hint=f"families: {', '.join(fit.get('families', {}))}")
    if not fam.get("lr_law") or not fam.get("batch_law"):
        raise UsageError(
            f"the fit's {family} family has no learning-rate or batch-size law", hint="; ".join(fit.get("notes", []))
        )
    lr_law, b_law = PowerLaw.from_json(fam["lr_law"]), PowerLaw.from_json(fam["batch_law"])
    lo, hi = min(lr_law.x_min, b_law.x_min), max(lr_law.x_max, b_law.x_max)
    factor = budget / hi if budget > hi else (lo / budget if budget < lo else 1.0)
    centre = math.sqrt(lo * hi)

    def band(law: PowerLaw) -> list[float]:
        se = law.exponent_stderr if math.isfinite(law.exponent_stderr) else 0.0
        spread = math.exp(abs(math.log(budget / centre)) * se)
        return [law(budget) / spread, law(budget) * spread]

    return {
        "family": family,
        "budget": budget,
        "lr": lr_law(budget),
        "batch_size": max(1, round(b_law(budget))),
        "lr_range": band(lr_law),
        "batch_range": band(b_law),
        "lr_law": lr_law.text("lr"),
        "batch_law": b_law.text("B"),
        "fitted_range": [lo, hi],
        "extrapolation": factor,
    }
