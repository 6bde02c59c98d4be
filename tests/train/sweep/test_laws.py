"""Fitting scaling laws: known power laws recovered from synthetic run results, within their stated errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from lingctl.core.errors import UsageError
from lingctl.train.sweep.laws import PointResult, PowerLaw, fit_power_law, fit_sweep, predict
from lingctl.train.sweep.plots import fit_table, plot_fit

BUDGETS = (1e15, 1e16, 1e17, 1e18)


def truth_lr(c: float) -> float:
    return 0.3118 * c**-0.125  # DeepSeek LLM's published laws


def truth_b(c: float) -> float:
    return 0.292 * c**0.3271


def synthetic(family: str, coef: float, seed: int = 0) -> list[PointResult]:
    """Runs on log grids around the truth; loss = L(C) * (1 + quadratic in log lr and log B) * noise."""
    rng = random.Random(seed)
    out = []
    for c in BUDGETS:
        for i in range(-4, 5):
            for j in range(-4, 5):
                lr, b = truth_lr(c) * 1.25**i * rng.uniform(0.97, 1.03), truth_b(c) * 1.3**j
                bowl = 1 + 0.004 * math.log(lr / truth_lr(c)) ** 2 + 0.003 * math.log(b / truth_b(c)) ** 2
                loss = coef * c**-0.05 * bowl * (1 + rng.gauss(0, 2e-4))
                out.append(
                    PointResult(
                        family=family, compute=c, lr=lr, batch_size=round(b), tokens=1, active_parameters=1, loss=loss
                    )
                )
    return out


@pytest.fixture(scope="module")
def fit() -> dict:
    return fit_sweep(synthetic("moe", 2.0) + synthetic("dense", 2.3, seed=1), tolerance=0.0025)


@pytest.mark.parametrize(("law", "exponent"), [("lr_law", -0.125), ("batch_law", 0.3271), ("loss_law", -0.05)])
def test_known_exponents_are_recovered_within_their_errors(fit: dict, law: str, exponent: float) -> None:
    for family in ("moe", "dense"):
        got = PowerLaw.from_json(fit["families"][family][law])
        assert abs(got.exponent - exponent) <= max(3 * got.exponent_stderr, 1e-3), (family, law, got)
        assert abs(got.exponent - exponent) < 0.03 and got.exponent_stderr < 0.03
        assert got.r2 > 0.3  # the near-optimal region is a band around the law, not a line


def test_the_lever_is_the_compute_ratio_at_equal_loss(fit: dict) -> None:
    # L = a C^-0.05 for both: dense needs (2.3 / 2.0)^(1/0.05) times the compute at every budget.
    expected = (2.3 / 2.0) ** 20
    assert len(fit["lever"]) == len(BUDGETS)
    for row in fit["lever"]:
        assert row["lever"] == pytest.approx(expected, rel=0.1)
    assert any("lever" in line for line in fit_table(fit))


def test_the_near_optimal_region_is_the_tolerance_around_the_best() -> None:
    pts = [
        PointResult(family="moe", compute=c, lr=lr, batch_size=4, tokens=1, active_parameters=1, loss=loss)
        for c in (1e10, 1e11)
        for lr, loss in ((1e-3, 3.0), (2e-3, 3.0 * 1.0024), (4e-3, 3.0 * 1.0026))
    ]
    budgets = fit_sweep(pts)["families"]["moe"]["budgets"]
    assert [sorted(n["lr"] for n in b["near_optimal"]) for b in budgets] == [[1e-3, 2e-3], [1e-3, 2e-3]]


def test_predict_interpolates_and_says_how_far_it_extrapolates(fit: dict) -> None:
    p = predict(fit, 1e17)
    assert p["lr"] == pytest.approx(truth_lr(1e17), rel=0.15)
    assert p["batch_size"] == pytest.approx(truth_b(1e17), rel=0.2)
    assert p["extrapolation"] == 1.0 and p["lr_range"][0] < p["lr"] < p["lr_range"][1]
    assert predict(fit, 1e21)["extrapolation"] == pytest.approx(1e3)
    assert predict(fit, 1e13)["extrapolation"] == pytest.approx(100)
    with pytest.raises(UsageError, match="no family 'sparse'"):
        predict(fit, 1e17, family="sparse")


def test_one_budget_gives_no_law_but_a_note() -> None:
    pts = synthetic("moe", 2.0)[:81]  # the first budget only
    fit = fit_sweep(pts)
    assert fit["families"]["moe"]["lr_law"] is None and any("not fitted" in n for n in fit["notes"])
    with pytest.raises(UsageError):
        predict(fit, 1e15)
    with pytest.raises(ValueError, match="two different budgets"):
        fit_power_law([1e15, 1e15], [1.0, 2.0])


def test_the_fit_round_trips_through_json_and_plots(fit: dict, tmp_path: Path) -> None:
    again = json.loads(json.dumps(fit))
    law = PowerLaw.from_json(again["families"]["moe"]["lr_law"])
    assert law == PowerLaw.from_json(fit["families"]["moe"]["lr_law"])
    written = plot_fit(fit, synthetic("moe", 2.0) + synthetic("dense", 2.3, seed=1), tmp_path)
    assert [p.name for p in written] == ["lr_loss.png", "laws.png", "loss_compute.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)
