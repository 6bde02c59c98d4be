"""``lingctl train --auto-hparams fit.json --budget FLOPS``: the learning rate, batch size and steps of a run
taken from a sweep's fitted laws, with what was picked and why; an extrapolation far beyond the budgets the laws
were fitted on is refused unless forced."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, UsageError
from lingctl.model.config import LingConfig
from lingctl.train.sweep.laws import predict
from lingctl.train.sweep.spec import active_parameters

log = logging.getLogger(__name__)

# How far past the fitted budgets a law is trusted: one decade. The published fits extrapolate further, from many
# more budgets; a toy sweep's exponent carries enough error that 10x beyond it is already a guess.
MAX_EXTRAPOLATION = 10.0


@dataclass(kw_only=True, slots=True)
class Picked:
    lr: float
    batch_size: int
    steps: int
    budget: float
    lines: list[str]


def pick(
    fit_path: Path, shape: LingConfig, seq_len: int, *, budget: float | None, steps: int | None, force: bool
) -> Picked:
    """``budget`` (FLOPs) sets the steps; without it, ``steps`` sets the budget (the batch size and the budget
    depend on each other: solved by iteration)."""
    try:
        fit: dict[str, Any] = json.loads(Path(fit_path).read_text())
    except OSError as exc:
        raise LingctlError(f"--auto-hparams: cannot read {fit_path}: {exc.strerror}") from None
    except ValueError:
        raise LingctlError(f"--auto-hparams: {fit_path} is not JSON (a fit.json of lingctl train fit)") from None
    if fit.get("format") != "lingctl-sweep-fit":
        raise UsageError(f"--auto-hparams: {fit_path} is not a fit.json of lingctl train fit")
    n = active_parameters(shape)
    per_step_token = 6.0 * n * seq_len
    if budget is None:
        if steps is None:
            raise UsageError("--auto-hparams needs --budget FLOPS or --steps N")
        budget = per_step_token * steps * 8
        for _ in range(20):  # B(C) grows slowly with C: a fixed point in a few rounds
            guess = predict(fit, budget)
            budget = per_step_token * steps * guess["batch_size"]
    p = predict(fit, budget)
    if p["extrapolation"] > MAX_EXTRAPOLATION and not force:
        lo, hi = p["fitted_range"]
        raise UsageError(
            f"--auto-hparams: a budget of {budget:.3g} FLOPs is {p['extrapolation']:.3g}x beyond the budgets the laws "
            f"were fitted on ({lo:.3g}-{hi:.3g})",
            hint="sweep closer to this budget, or pass --force-extrapolation to use the laws anyway",
        )
    batch = int(p["batch_size"])
    n_steps = steps if steps is not None else max(1, round(budget / (per_step_token * batch)))
    lines = [
        f"auto-hparams from {fit_path} ({p['family']}): budget {budget:.3g} FLOPs, {n:,} active parameters",
        f"  lr {p['lr']:.3g} from {p['lr_law']}",
        f"  batch size {batch} from {p['batch_law']}",
        f"  steps {n_steps} = budget / (6 x N x batch x seq_len {seq_len})",
        f"  fitted on {p['fitted_range'][0]:.3g}-{p['fitted_range'][1]:.3g} FLOPs; extrapolation {p['extrapolation']:.3g}x",
    ]
    return Picked(lr=float(p["lr"]), batch_size=batch, steps=n_steps, budget=budget, lines=lines)
