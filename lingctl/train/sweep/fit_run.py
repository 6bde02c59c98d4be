"""``lingctl train fit SWEEP``: the sweep's finished points fitted (``laws.py``), written as ``SWEEP/fit.json``
with the plots beside it (``SWEEP/fit/*.png``), and the table the command prints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import NotFoundError, UsageError
from lingctl.train.sweep.laws import fit_sweep
from lingctl.train.sweep.plots import fit_table, plot_fit
from lingctl.train.sweep.runner import SPEC_FILE, point_results, read_results

FIT = "fit.json"
PLOTS = "fit"


@dataclass(kw_only=True, slots=True)
class FitReport:
    fit: dict[str, Any]
    lines: list[str]


def fit_directory(directory: Path, *, tolerance: float = 0.0025) -> FitReport:
    if not (directory / SPEC_FILE).exists():
        raise NotFoundError(f"{directory} holds no sweep ({SPEC_FILE} is missing)")
    records = read_results(directory)
    if len(records) < 2:
        raise UsageError(f"{directory} has {len(records)} finished point(s); a fit needs more", hint="run the sweep")
    results = point_results(records)
    fit = fit_sweep(results, tolerance=tolerance)
    fit["sweep"] = str(directory)
    fit["points"] = len(records)
    with atomic_write(directory / FIT) as (_, f):
        f.write(json.dumps(fit, indent=1).encode())
    plots: list[str] = []
    try:
        (directory / PLOTS).mkdir(exist_ok=True)
        plots = [str(p) for p in plot_fit(fit, results, directory / PLOTS)]
    except ImportError:
        fit.setdefault("notes", []).append("plots not drawn: matplotlib is not installed")
    fit["plots"] = plots
    lines = fit_table(fit) + [
        f"written: {directory / FIT}" + (f" and {len(plots)} plots in {directory / PLOTS}" if plots else "")
    ]
    return FitReport(fit=fit, lines=lines)
