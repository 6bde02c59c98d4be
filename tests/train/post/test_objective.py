"""Packing is exact: a packed batch gives the loss and gradients of its examples run one at a time (fp32),
for SFT and DPO, with the MoE balance loss and z-loss on."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset
from lingctl.runs.train_config import Stage
from lingctl.train import losses
from lingctl.train.post.batch import PackedBatch
from lingctl.train.post.examples import Example, Pair
from lingctl.train.post.logps import example_logps
from lingctl.train.post.objective import Finetuning
from lingctl.train.post.packing import pack

BALANCE, Z = 0.01, 0.001


@pytest.fixture(scope="module")
def model() -> LingForCausalLM:
    cfg = preset("tiny")
    cfg.vocab_size = 97
    cfg.initializer_range = 0.2  # routing far from uniform, so the balance loss has a real gradient
    torch.manual_seed(0)
    m = LingForCausalLM(cfg)
    m.init_weights(torch.Generator().manual_seed(0))
    return m


def random_example(rng: random.Random, i: int, prompt: list[int] | None = None) -> Example:
    prompt = prompt if prompt is not None else [rng.randrange(97) for _ in range(rng.randint(1, 9))]
    answer = [rng.randrange(97) for _ in range(rng.randint(1, 14))]
    return Example(ids=prompt + answer, loss_mask=[False] * len(prompt) + [True] * len(answer), where=f"f:{i}")


def one_by_one(model: LingForCausalLM, seqs: list[Example]) -> tuple[list[torch.Tensor], list[int], list]:
    """Per example alone (no packing, no padding): its trained tokens' log-probabilities, and the routes."""
    logps, counts, routes = [], [], []
    for ex in seqs:
        ids = torch.tensor([ex.ids])
        out = model(ids)
        mask = torch.tensor(ex.loss_mask[1:])
        logp = -F.cross_entropy(out.logits[0, :-1], ids[0, 1:], reduction="none")
        logps.append(logp[mask])
        counts.append(int(mask.sum()))
        routes.append(out.routes)
    merged = [
        losses.RouterOutput(*(torch.cat([getattr(r[layer], f) for r in routes]) for f in losses.RouterOutput.__slots__))
        for layer in range(len(routes[0]))
    ]
    return logps, counts, merged


def grads(model: LingForCausalLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = float((a[name] - b[name]).norm())
        assert diff <= 1e-5 * float(b[name].norm()) + 1e-9, (name, diff, float(b[name].norm()))


def finetuning(kind: str, rows) -> Finetuning:
    return Finetuning(
        kind, rows, None, num_experts=8, balance_coef=BALANCE, z_coef=Z, bf16=False, beta=0.3, nll_weight=0.05
    )


def test_a_packed_sft_batch_equals_its_examples_one_by_one(model: LingForCausalLM) -> None:
    rng = random.Random(0)
    examples = [random_example(rng, i) for i in range(12)]
    rows = pack(examples, [Stage(32, None)])
    assert len(rows) < len(examples)  # several examples share rows, and the last row is padded in the batch
    objective = finetuning("sft", rows)
    parts = objective.loss(model, PackedBatch.of(rows, list(range(len(rows)))))
    packed = grads(model, parts["loss"])

    logps, counts, routes = one_by_one(model, examples)
    lm = -torch.cat(logps).sum() / sum(counts)
    bal, z = losses.balance_loss(routes, 8), losses.z_loss(routes)
    loss = lm + BALANCE * bal + Z * z
    torch.testing.assert_close(parts["lm_loss"], lm, rtol=1e-5, atol=0)
    torch.testing.assert_close(parts["balance_loss"], bal, rtol=1e-5, atol=0)
    torch.testing.assert_close(parts["z_loss"], z, rtol=1e-5, atol=0)
    assert_same(packed, grads(model, loss))


def test_a_packed_dpo_batch_equals_its_pairs_one_by_one(model: LingForCausalLM) -> None:
    rng = random.Random(1)
    pairs = []
    for i in range(8):
        prompt = [rng.randrange(97) for _ in range(rng.randint(1, 8))]
        pairs.append(
            Pair(chosen=random_example(rng, i, prompt), rejected=random_example(rng, i, prompt), where=f"f:{i}")
        )
    rows = pack(pairs, [Stage(48, None)])
    assert len(rows) < len(pairs)
    reference = torch.randn(len(pairs), 2, dtype=torch.float64) - 20
    objective = finetuning("dpo", rows)
    objective.reference = {"train": reference}
    parts = objective.loss(model, PackedBatch.of(rows, list(range(len(rows)))))
    packed = grads(model, parts["loss"])

    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    logps, counts, routes = one_by_one(model, seqs)
    pi = torch.stack([lp.sum() for lp in logps]).view(-1, 2)
    margin = 0.3 * ((pi[:, 0] - reference[:, 0].float()) - (pi[:, 1] - reference[:, 1].float()))
    nll = -torch.cat(logps[::2]).sum() / sum(counts[::2])
    task = -F.logsigmoid(margin).mean() + 0.05 * nll
    loss = task + BALANCE * losses.balance_loss(routes, 8) + Z * losses.z_loss(routes)
    torch.testing.assert_close(parts["lm_loss"], task, rtol=1e-5, atol=0)
    torch.testing.assert_close(parts["loss"], loss, rtol=1e-5, atol=0)
    assert_same(packed, grads(model, loss))
    assert parts["extra"]["reward_margin"] == pytest.approx(float(margin.detach().mean()), rel=1e-4, abs=1e-5)


def test_padding_enters_no_auxiliary_loss_or_expert_count(model: LingForCausalLM) -> None:
    rng = random.Random(2)
    short = [random_example(rng, i) for i in range(3)]
    long_ = Example(ids=list(range(1, 61)), loss_mask=[False] + [True] * 59, where="f:9")
    rows = pack([*short, long_], [Stage(64, None)])
    batch = PackedBatch.of(rows, list(range(len(rows))))
    assert len(rows) == 2 and not bool(batch.real_BL.all())  # the shorter row is padded to the longer one
    parts = finetuning("sft", rows).loss(model, batch)
    assert all(r.topk_idx_TK.shape[0] == batch.n_tokens for r in parts["routes"])
    alone = [finetuning("sft", rows).loss(model, PackedBatch.of(rows, [r])) for r in range(2)]
    merged = [
        losses.RouterOutput(
            *(torch.cat([getattr(a["routes"][layer], f) for a in alone]) for f in losses.RouterOutput.__slots__)
        )
        for layer in range(len(parts["routes"]))
    ]
    torch.testing.assert_close(parts["balance_loss"], losses.balance_loss(merged, 8), rtol=1e-5, atol=0)
    torch.testing.assert_close(parts["z_loss"], losses.z_loss(merged), rtol=1e-5, atol=0)


def test_example_logps_match_a_plain_forward(model: LingForCausalLM) -> None:
    rng = random.Random(3)
    examples = [random_example(rng, i) for i in range(5)]
    logps, _, _ = one_by_one(model, examples)
    torch.testing.assert_close(
        example_logps(model, examples, seq_len=40),
        torch.stack([lp.sum() for lp in logps]).double(),
        rtol=1e-5,
        atol=1e-5,
    )
