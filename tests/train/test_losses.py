from __future__ import annotations

import math

import pytest
import torch

from lingctl.model.moe import RouterOutput
from lingctl.train.losses import balance_loss, expert_load, z_loss


def route(idx: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor | None = None) -> RouterOutput:
    logits = probs.log() if logits is None else logits
    return RouterOutput(idx, torch.ones(idx.shape), logits, probs)


@pytest.mark.parametrize("experts,k", [(8, 2), (64, 6), (16, 1)])
def test_balance_loss_equals_alpha_under_uniform_routing(experts: int, k: int) -> None:
    tokens = experts * 4
    # Every expert gets exactly the same number of slots and the same mean probability.
    idx = (torch.arange(tokens * k) % experts).view(tokens, k)
    probs = torch.full((tokens, experts), 1.0 / experts)
    alpha = 0.01
    value = alpha * balance_loss([route(idx, probs), route(idx, probs)], experts)
    assert value.item() == pytest.approx(alpha, rel=1e-6)


def test_balance_loss_grows_with_imbalance_and_has_gradient_through_probs() -> None:
    experts, tokens = 4, 32
    logits = torch.zeros(tokens, experts, requires_grad=True)
    probs = (logits + torch.tensor([3.0, 0.0, 0.0, 0.0])).softmax(-1)
    idx = torch.zeros(tokens, 1, dtype=torch.long)  # everything to expert 0
    value = balance_loss([route(idx, probs, logits)], experts)
    # f = [1,0,0,0]; P_0 = softmax([3,0,0,0])_0
    p0 = math.exp(3) / (math.exp(3) + 3)
    assert value.item() == pytest.approx(experts * p0, rel=1e-5)
    value.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_z_loss_matches_its_formula() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(10, 6) * 3, torch.randn(7, 6)
    idx = torch.zeros(10, 1, dtype=torch.long)
    expected_a = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in a.tolist()) / 10
    expected_b = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in b.tolist()) / 7
    value = z_loss([route(idx, a.softmax(-1), a), route(idx[:7], b.softmax(-1), b)])
    assert value.item() == pytest.approx((expected_a + expected_b) / 2, rel=1e-5)


def test_expert_load_reports_relative_max_min_and_cv() -> None:
    idx = torch.tensor([[0], [0], [0], [1]])  # counts [3, 1, 0, 0], mean 1
    stats = expert_load([route(idx, torch.full((4, 4), 0.25))], 4)
    assert stats == [{"max": 3.0, "min": 0.0, "cv": pytest.approx(math.sqrt((4 + 0 + 1 + 1) / 4), abs=1e-4)}]
