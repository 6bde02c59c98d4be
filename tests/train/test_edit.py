"""EDiT local SGD: exactness against plain training, layer-wise == whole-model, penalties, clipping, state.

Multi-worker scenarios run once per world size in real gloo processes (a module fixture) and return plain
values; the tests below check them. The model is an embedding and three linear layers, trained by AdamW on
seeded random tokens, so everything is deterministic.
"""

from __future__ import annotations

import copy
import math
from typing import Any, TypedDict, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lingctl.runs.train_config import EditConfig
from lingctl.train.edit import EditSynchronizer
from tests.support.dist import run_workers

V, D, K = 32, 8, 4  # vocabulary, width, local steps per sync


class ExactOuterStep(TypedDict):
    outer_lr: float
    outer_momentum: float
    clip_norm: float | None


EXACT = ExactOuterStep(outer_lr=1.0, outer_momentum=0.0, clip_norm=None)  # the outer step returns the average itself


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)  # identical on every worker, as the trainer's seeded init is
    return nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))


def units(model: nn.Sequential) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    return [(m, list(m.parameters())) for m in model if any(True for _ in m.parameters())]


class Replica:
    """One worker's model, AdamW and synchronizer; ``seed`` picks its data stream."""

    def __init__(self, config: EditConfig | None, seed: int, *, delta_scale: float = 1.0) -> None:
        self.model = tiny_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.sync: EditSynchronizer | None = (
            None if config is None else EditSynchronizer(units(self.model), config, delta_scale=delta_scale)
        )
        self.seed, self.step = seed, 0

    def train_step(self) -> None:
        g = torch.Generator().manual_seed(self.seed * 10007 + self.step)
        ids_BS = torch.randint(0, V, (4, 9), generator=g)
        logits = self.model(ids_BS[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), ids_BS[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.step += 1

    def round(self, layerwise: bool = False) -> None:
        """K local steps, then a sync: whole-model now, or armed for the forward of the next step."""
        for _ in range(K):
            self.train_step()
        assert self.sync is not None
        if layerwise:
            self.sync.arm()
            self.train_step()
            self.sync.finish()
        else:
            self.sync.sync_now()
            self.train_step()

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def same_state(a: EditSynchronizer, b: EditSynchronizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    tensors = [(sa[n][k], sb[n][k]) for n in ("anchor", "momentum") for k in sa[n]]
    tensors += [(sa[n], sb[n]) for n in ("norm_mean", "norm_var", "norm_count")]
    return sa["syncs"] == sb["syncs"] and all(torch.equal(x, y) for x, y in tensors)


# -- two workers ------------------------------------------------------------------------------------------
def _two_workers(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    # Identical data on both workers: local SGD with the exact outer step is plain training, bit for bit.
    plain, edit = Replica(None, seed=0), Replica(EditConfig(**EXACT), seed=0)
    for _ in range(3):
        edit.round()
        for _ in range(K + 1):
            plain.train_step()
    out["identical_exact_equals_plain"] = torch.equal(edit.flat(), plain.flat())
    defaults = Replica(EditConfig(), seed=0)
    for _ in range(3):
        defaults.round()
    out["identical_defaults"] = defaults.flat()

    # Different data: layer-wise (arm + a training step + finish) against whole-model, in lockstep.
    whole = Replica(EditConfig(), seed=rank + 1)
    layer = copy.deepcopy(whole)
    assert whole.sync is not None and layer.sync is not None
    for _ in range(3):
        whole.round(layerwise=False)
        layer.round(layerwise=True)
    out["layerwise_equal"] = torch.equal(whole.flat(), layer.flat()) and same_state(whole.sync, layer.sync)
    out["hooks_left"] = sum(len(m._forward_pre_hooks) for m in layer.model)
    out["state"] = copy.deepcopy(whole.sync.state_dict())
    out["stats"] = whole.sync.last
    out["params"] = sum(p.numel() for p in whole.model.parameters())
    # A unit the forward never reaches is completed by finish().
    partial = copy.deepcopy(whole)
    assert partial.sync is not None
    for _ in range(K):
        whole.train_step()
        partial.train_step()
    whole.sync.sync_now()
    partial.sync.arm()
    partial.model[:2](torch.zeros(1, 3, dtype=torch.long))  # embedding and first linear only
    pending = partial.sync._sync
    # Units 0 and 1 applied in their hooks; unit 2's all_reduce was prefetched by unit 1's hook.
    out["prefetched"] = pending is not None and pending.done == [True, True, False, False] and pending.launched == 3
    partial.sync.finish()
    out["partial_equal"] = torch.equal(whole.flat(), partial.flat()) and same_state(whole.sync, partial.sync)

    # After a sync each worker's parameters are the common new anchor, up to rounding.
    anchor = torch.cat(whole.sync.anchor)
    out["off_anchor"] = float((whole.flat() - anchor).abs().max())
    gathered = [torch.empty_like(anchor) for _ in range(world)]
    dist.all_gather(gathered, whole.flat())
    out["spread"] = float((gathered[0] - gathered[1]).abs().max())

    # Restoring a synchronizer (and the worker's model and AdamW) from saved state continues identically.
    restored = copy.deepcopy(whole)
    restored.sync = EditSynchronizer(units(restored.model), EditConfig())
    restored.sync.load_state_dict(copy.deepcopy(whole.sync.state_dict()))
    for _ in range(2):
        whole.round()
        restored.round()
    out["restored_equal"] = torch.equal(whole.flat(), restored.flat()) and same_state(whole.sync, restored.sync)

    # A small clip: the averaged delta of every unit is capped; with lr 1 and no momentum it is what the
    # anchor moves by.
    clipped = Replica(EditConfig(outer_lr=1.0, outer_momentum=0.0, clip_norm=0.05), seed=rank + 1)
    assert clipped.sync is not None
    out["clip"] = []
    for _ in range(2):
        before = [a.clone() for a in clipped.sync.anchor]
        clipped.round()
        moved = [float(torch.linalg.vector_norm(b - a)) for b, a in zip(before, clipped.sync.anchor)]
        assert clipped.sync.last is not None
        out["clip"].append((clipped.sync.last.delta_norms, moved, clipped.sync.last.clipped))
    return out


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_workers(_two_workers, 2)


@pytest.mark.slow
def test_two_workers_on_identical_data_match_plain_training_and_each_other(two: list[dict[str, Any]]) -> None:
    assert all(r["identical_exact_equals_plain"] for r in two)
    assert torch.equal(two[0]["identical_defaults"], two[1]["identical_defaults"])


@pytest.mark.slow
def test_layerwise_sync_equals_whole_model_sync_bit_for_bit(two: list[dict[str, Any]]) -> None:
    assert all(r["layerwise_equal"] and r["partial_equal"] and r["prefetched"] for r in two)
    assert all(r["hooks_left"] == 0 for r in two)


@pytest.mark.slow
def test_state_is_replicated_and_parameters_rejoin_the_anchor(two: list[dict[str, Any]]) -> None:
    a, b = two[0]["state"], two[1]["state"]
    assert a["syncs"] == b["syncs"] == 3
    for name in ("anchor", "momentum"):
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])
    assert all(torch.equal(a[n], b[n]) for n in ("norm_mean", "norm_var", "norm_count"))
    # Rounding only: theta_i + (delta_i - lr * update) versus anchor - lr * update.
    assert all(r["off_anchor"] < 1e-6 and r["spread"] < 1e-6 for r in two)


@pytest.mark.slow
def test_sync_stats_count_payload_and_weights(two: list[dict[str, Any]]) -> None:
    for r in two:
        stats = r["stats"]
        assert stats.bytes_sent == 4 * (4 + r["params"])  # 4 unit norms + every parameter once, fp32
        assert stats.wait_s >= 0 and stats.dropped == [0, 0] and len(stats.delta_norms) == 4
        assert all(sum(w) == pytest.approx(1.0) for w in stats.weights)
        assert stats.to_record()["weights"] == [round(w, 6) for w in stats.worker_weights()]
    # Weights and drops come from the gathered norms, so every worker computes the same ones.
    assert two[0]["stats"].weights == two[1]["stats"].weights
    assert two[0]["stats"].delta_norms == two[1]["stats"].delta_norms


@pytest.mark.slow
def test_a_restored_synchronizer_continues_identically(two: list[dict[str, Any]]) -> None:
    assert all(r["restored_equal"] for r in two)


@pytest.mark.slow
def test_averaged_delta_norm_never_exceeds_the_clip(two: list[dict[str, Any]]) -> None:
    for r in two:
        for norms, moved, clipped in r["clip"]:
            assert clipped == 4  # the cap is far below these deltas, so every unit is clipped
            assert all(n <= 0.05 for n in norms)
            assert all(m == pytest.approx(0.05, rel=1e-4) for m in moved)


# -- three workers, one of them bad --------------------------------------------------------------------------
BAD = 2


def _three_workers(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    # Bad from the first sync: the z-test is still warming up, the softmax alone mutes it.
    r = Replica(EditConfig(), seed=rank + 1, delta_scale=100.0 if rank == BAD else 1.0)
    assert r.sync is not None
    out["softmax"] = []
    for _ in range(2):
        r.round()
        out["softmax"].append(r.sync.last)

    # Near-uniform weights (huge T), so only anomaly elimination can keep the bad delta out; the worker
    # turns bad after the warm-up.
    config = EditConfig(**EXACT, weight_temperature=1e6, anomaly_warmup=2, anomaly_threshold=10.0)
    r = Replica(config, seed=rank + 1)
    assert r.sync is not None
    out["dropped"] = []
    for i in range(4):
        if i == 3 and rank == BAD:
            r.sync.delta_scale = 100.0
        for _ in range(K):
            r.train_step()
        anchor = torch.cat(r.sync.anchor)
        thetas = [torch.empty_like(anchor) for _ in range(world)]
        dist.all_gather(thetas, r.flat())
        r.sync.sync_now()
        assert r.sync.last is not None
        out["dropped"].append(r.sync.last.dropped)
    # The good workers' weighted average, from their deltas and the weights the sync reported.
    assert r.sync.last is not None
    weights, sizes = r.sync.last.weights, [a.numel() for a in r.sync.anchor]
    expected = []
    for u, (anchor_u, *thetas_u) in enumerate(zip(anchor.split(sizes), *(t.split(sizes) for t in thetas))):
        g = sum(weights[u][j] * (anchor_u.double() - thetas_u[j].double()) for j in range(world) if j != BAD)
        expected.append(anchor_u.double() - g)
    out["weights"] = weights
    out["error"] = float((r.flat().double() - torch.cat(expected)).abs().max())
    return out


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    return run_workers(_three_workers, 3)


@pytest.mark.slow
def test_a_bad_worker_gets_a_negligible_softmax_weight_before_the_anomaly_test(three: list[dict[str, Any]]) -> None:
    for stats in three[0]["softmax"]:
        assert stats.dropped == [0, 0, 0]  # still in warm-up
        assert all(w[BAD] < 1e-6 for w in stats.weights)
        assert all(w[0] > 0.1 and w[1] > 0.1 for w in stats.weights)


@pytest.mark.slow
def test_after_warmup_a_bad_worker_is_dropped_and_the_others_move_without_it(three: list[dict[str, Any]]) -> None:
    for r in three:
        assert r["dropped"][:3] == [[0, 0, 0]] * 3
        assert r["dropped"][3] == [0, 0, 4]
        assert all(w[BAD] == 0.0 and math.isclose(w[0] + w[1], 1.0) for w in r["weights"])
        # Every worker, the bad one too, lands on the good workers' average.
        assert r["error"] < 1e-6


# -- one process -------------------------------------------------------------------------------------------
def test_a_worker_with_no_local_step_since_the_sync_takes_no_part() -> None:
    """At a time-based (or the final) sync a slow worker may have taken no step: its delta is exactly zero,
    and softmax(-norm) would give it the largest weight, pulling the average back to the anchor."""
    sync = EditSynchronizer(units(tiny_model()), EditConfig())
    U = len(sync.units)
    sync.norm_mean, sync.norm_var = torch.zeros(U, 2, dtype=torch.float64), torch.zeros(U, 2, dtype=torch.float64)
    sync.norm_count = torch.zeros(U, 2, dtype=torch.int64)
    norms_UW = torch.tensor([[0.8, 0.0]] * U, dtype=torch.float64)
    weights_UW, dropped_UW = sync._penalties(norms_UW)
    assert weights_UW[:, 1].eq(0).all() and weights_UW[:, 0].eq(1).all()
    assert not dropped_UW.any()  # not an anomaly: it had nothing to send
    assert sync.norm_count[:, 1].eq(0).all()  # and its zero norm did not enter its statistics
    # Everyone empty (nothing trained since the sync): all stay in, with equal weights and nothing to move.
    weights_UW, _ = sync._penalties(torch.zeros(U, 2, dtype=torch.float64))
    assert weights_UW.eq(0.5).all()


def test_one_worker_with_the_exact_outer_step_reproduces_plain_training_bit_for_bit() -> None:
    plain, edit = Replica(None, seed=3), Replica(EditConfig(**EXACT), seed=3)
    for i in range(3):
        edit.round(layerwise=i % 2 == 1)
        for _ in range(K + 1):
            plain.train_step()
        assert torch.equal(edit.flat(), plain.flat())
    assert edit.sync is not None and edit.sync.last is not None
    assert edit.sync.last.weights == [[1.0]] * 4 and edit.sync.last.bytes_sent == 0


def test_layerwise_sync_on_the_ling_model_matches_sync_now() -> None:
    from lingctl.model.ling import LingForCausalLM
    from lingctl.model.presets import preset

    def build() -> tuple[LingForCausalLM, torch.optim.Optimizer, EditSynchronizer]:
        model = LingForCausalLM(preset("tiny"))
        model.init_weights(torch.Generator().manual_seed(0))
        m = model.model
        ling_units: list[tuple[nn.Module, list[torch.Tensor]]] = [(m.word_embeddings, [m.word_embeddings.weight])]
        ling_units += [(layer, list(layer.parameters())) for layer in m.layers]
        ling_units.append((m.norm, [m.norm.weight, model.lm_head.weight]))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), EditSynchronizer(ling_units, EditConfig())

    def step(model: LingForCausalLM, opt: torch.optim.Optimizer, i: int) -> None:
        ids_BS = torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(i))
        logits = model(ids_BS[:, :-1]).logits
        F.cross_entropy(logits.reshape(-1, 1024), ids_BS[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    (ma, oa, sa), (mb, ob, sb) = build(), build()
    for i in range(4):
        step(ma, oa, i)
        step(mb, ob, i)
    sa.sync_now()
    step(ma, oa, 4)
    sb.arm()
    step(mb, ob, 4)
    assert sb.syncs == 1  # completed inside the forward, by the hooks
    sb.finish()
    assert all(torch.equal(a, b) for a, b in zip(ma.parameters(), mb.parameters()))
    assert sa.last is not None and sb.last is not None
    assert same_state(sa, sb) and sa.last.delta_norms == sb.last.delta_norms


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("outer_lr", 0.0),
        ("outer_lr", float("nan")),
        ("outer_momentum", 1.0),
        ("outer_momentum", -0.1),
        ("anomaly_alpha", 0.0),
        ("anomaly_alpha", 1.5),
        ("anomaly_threshold", -1.0),
        ("anomaly_warmup", 0),
        ("weight_temperature", 0.0),
        ("clip_norm", 0.0),
        ("clip_norm", float("inf")),
    ],
)
def test_bad_config_values_are_refused_with_the_value_named(field: str, value: float) -> None:
    config = EditConfig(**cast(dict[str, Any], {field: value}))
    with pytest.raises(ValueError, match=f"edit.{field} .* got {value!r}"):
        config.validate()
    with pytest.raises(ValueError, match=field):
        EditSynchronizer(units(tiny_model()), config)


def test_units_must_cover_each_parameter_exactly_once() -> None:
    model = tiny_model()
    good = units(model)
    with pytest.raises(ValueError, match="in EDiT units 0 and 1"):
        EditSynchronizer(
            [good[0], (model[1], [*model[1].parameters(), cast(nn.Embedding, model[0]).weight])], EditConfig()
        )
    with pytest.raises(ValueError, match="'bias' of EDiT unit 1"):
        EditSynchronizer([good[0], (model[1], [cast(nn.Linear, model[1]).weight])], EditConfig())
    with pytest.raises(ValueError, match="delta_scale .* got 0.0"):
        EditSynchronizer(good, EditConfig(), delta_scale=0.0)


def test_a_sync_in_progress_blocks_state_access_until_finish() -> None:
    r = Replica(EditConfig(), seed=1)
    assert r.sync is not None
    for _ in range(K):
        r.train_step()
    r.sync.arm()
    with pytest.raises(RuntimeError, match="finish"):
        r.sync.state_dict()
    r.sync.finish()  # no forward ran: every unit is completed here
    assert r.sync.syncs == 1 and all(len(m._forward_pre_hooks) == 0 for m in r.model)


def test_a_non_finite_pseudo_gradient_everywhere_is_an_error_not_a_silent_nan_model() -> None:
    r = Replica(EditConfig(), seed=1)
    assert r.sync is not None
    with torch.no_grad():
        cast(nn.Linear, r.model[1]).weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="unit 1"):
        r.sync.sync_now()
    r.sync.state_dict()  # nothing left pending
