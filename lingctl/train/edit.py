"""EDiT local SGD: workers train alone and periodically merge, layer by layer, with pseudo-gradient penalties.

Between syncs every worker takes ordinary AdamW steps on its own data. A sync (Ling technical report §2.2,
after EDiT, Cheng et al. 2024) treats what each worker learned since the last sync as a pseudo-gradient
``delta_i = anchor - theta_i``, combines the workers' deltas per *unit* (embeddings, each decoder layer,
final norm + head) and applies the result with an outer SGD-with-Nesterov-momentum step from the anchor.
The penalties keep one noisy worker from spiking the loss:

* anomaly elimination: a worker whose delta norm is far above its own EMA for that unit (z-test) is dropped;
* norm-weighted averaging: the kept workers are weighted by ``softmax(-||delta_i|| / T)``;
* clipping: the averaged delta's norm is capped per unit.

Layer-wise mode runs the sync inside the forward of the sync step: a forward pre-hook on each unit's module
waits for that unit's all_reduce and applies it, after launching the next unit's all_reduce, so the
communication of unit k+1 overlaps the compute of unit k. The whole-model path (``sync_now``) runs the very
same per-unit code in the same order, so both give bit-identical parameters.

Shapes: U units, W workers, N the elements of one unit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lingctl.runs.train_config import EditConfig

# Parameters as tensors: nn.Embedding and nn.Linear declare their weights as Tensor.
Unit = tuple[nn.Module, list[torch.Tensor]]

# The z-test's deviation is sqrt(var + eps) with eps = (STD_FLOOR * mean)^2 + TINY: with a few syncs of
# history, or a very steady run, the variance is close to 0 and every small rise would be "many sigmas";
# the floor means a norm must rise by more than threshold * STD_FLOOR (15% with the defaults) to be dropped.
STD_FLOOR = 0.05
TINY = 1e-12


@dataclass(kw_only=True, slots=True)
class SyncStats:
    """What the last sync did. Every worker computes the same weights and drops; bytes and waits are its own."""

    sync: int  # syncs completed, this one included
    weights: list[list[float]]  # [U][W]: each worker's weight in each unit's average (0.0: dropped)
    dropped: list[int]  # [W]: units in which the worker's delta was anomalous and dropped
    bytes_sent: int  # payload this worker put into collectives: its row of norms + its weighted deltas
    wait_s: float  # seconds blocked in the norm all_gather and in waits for all_reduces
    delta_norms: list[float]  # [U]: norm of the averaged delta after clipping
    clipped: int  # units whose averaged delta was clipped

    def worker_weights(self) -> list[float]:
        """[W]: each worker's weight averaged over units."""
        return [sum(col) / len(col) for col in zip(*self.weights)]

    def to_record(self) -> dict[str, Any]:
        """The metrics-line fields (the sync count is left to the caller's record)."""
        return {
            "weights": [round(w, 6) for w in self.worker_weights()],
            "dropped": self.dropped,
            "bytes_sent": self.bytes_sent,
            "wait_s": round(self.wait_s, 4),
            "delta_norms": [round(n, 6) for n in self.delta_norms],
            "clipped": self.clipped,
        }


@dataclass(slots=True)
class _Sync:
    """One sync in progress: the penalties decided from the gathered norms, and the all_reduces in flight."""

    weights_UW: torch.Tensor  # float64
    dropped_UW: torch.Tensor  # bool
    bufs: list[torch.Tensor | None]  # per unit: this worker's weighted delta, then the all_reduced sum
    works: list[Any]  # per unit: the async all_reduce handle (None in one-process mode)
    launched: int = 0  # units 0 .. launched-1 have their all_reduce started
    done: list[bool] = field(default_factory=list)
    bytes_sent: int = 0
    wait_s: float = 0.0
    delta_norms: list[float] = field(default_factory=list)
    clipped: int = 0


class EditSynchronizer:
    def __init__(self, units: list[Unit], config: EditConfig, group: Any = None, *, delta_scale: float = 1.0) -> None:
        """``units``: (module whose forward pre-hook marks when the unit's parameters are needed, the
        parameters it syncs), in forward order. The parameters must be identical on every worker now (the
        anchor starts from them). Without an initialised process group it runs as a single worker.

        ``delta_scale`` multiplies this worker's pseudo-gradient before it is measured and sent (fault
        drills: ``--simulate-bad-rank``); the worker still rejoins the common parameters. It may be changed
        between syncs."""
        config.validate()
        if not math.isfinite(delta_scale) or delta_scale <= 0:
            raise ValueError(f"delta_scale must be a finite number > 0, got {delta_scale!r}")
        self.units = [(module, list(params)) for module, params in units]
        _check_units(self.units)
        self.config = config
        self.group = group
        self.delta_scale = delta_scale
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        U, W = len(self.units), self.world
        with torch.no_grad():
            self.anchor = [self._flat(k) for k in range(U)]  # [N] fp32 each: theta at the last sync
        self.momentum = [torch.zeros_like(a) for a in self.anchor]  # [N] fp32 each: outer Nesterov buffer
        # Every worker keeps every worker's statistics, updated identically from the all-gathered norms.
        self.norm_mean = torch.zeros(U, W, dtype=torch.float64)
        self.norm_var = torch.zeros(U, W, dtype=torch.float64)
        self.norm_count = torch.zeros(U, W, dtype=torch.int64)  # norms accepted into the statistics
        self.syncs = 0
        self.last: SyncStats | None = None
        self._sync: _Sync | None = None
        self._hooks: list[Any] = []

    # -- public ---------------------------------------------------------------------------------------
    def sync_now(self) -> None:
        """Synchronise the whole model now, unit by unit in order."""
        self._begin()
        for k in range(len(self.units)):
            self._advance(k)

    def arm(self) -> None:
        """Prepare a sync that completes during the next forward (or now, with ``layerwise`` off); call
        ``finish()`` after that forward. A unit whose hook did not fire is completed in ``finish()``: if one
        may be skipped, call it before the optimizer step, or that unit's local step is overwritten."""
        if not self.config.layerwise:
            self.sync_now()
            return
        self._begin()
        self._launch_through(0)
        for k, (module, _) in enumerate(self.units):
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(k)))

    @property
    def last_stats(self) -> SyncStats:
        """The statistics of the last completed sync: valid once ``sync_now()`` or ``finish()`` has run."""
        if self.last is None:
            raise RuntimeError("no EDiT sync has completed yet")
        return self.last

    def finish(self) -> None:
        """Complete the units whose hook did not fire (a unit the forward did not reach) and drop the hooks."""
        if self._sync is not None:
            for k in range(len(self.units)):
                self._advance(k)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        assert self._sync is None, "a sync is still pending after finish()"

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """anchor = the current parameters (at start, or after a DDP warm-up); they must agree across workers."""
        self._idle("reset_anchor")
        for k, anchor in enumerate(self.anchor):
            anchor.copy_(self._flat(k))

    def state_dict(self) -> dict[str, Any]:
        """Replicated state (identical on every worker), as the live tensors: DCP may load into them."""
        self._idle("state_dict")
        return {
            "syncs": self.syncs,
            "anchor": {str(k): a for k, a in enumerate(self.anchor)},
            "momentum": {str(k): m for k, m in enumerate(self.momentum)},
            "norm_mean": self.norm_mean,
            "norm_var": self.norm_var,
            "norm_count": self.norm_count,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._idle("load_state_dict")
        pairs = [
            (state[name][str(k)], dst, f"{name}.{k}")
            for name, dsts in (("anchor", self.anchor), ("momentum", self.momentum))
            for k, dst in enumerate(dsts)
        ]
        pairs += [(state[name], getattr(self, name), name) for name in ("norm_mean", "norm_var", "norm_count")]
        for src, dst, name in pairs:
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"EDiT state {name} has shape {tuple(src.shape)}, this run needs {tuple(dst.shape)} "
                    "(different model or number of workers)"
                )
        for src, dst, _ in pairs:
            dst.copy_(src)
        self.syncs = int(state["syncs"])

    # -- one sync -----------------------------------------------------------------------------------
    def _flat(self, k: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.units[k][1]])  # [N] fp32

    def _delta(self, k: int) -> torch.Tensor:
        return self.anchor[k] - self._flat(k)  # [N] fp32: what this worker learned since the last sync

    def _sent_delta(self, k: int) -> torch.Tensor:
        delta = self._delta(k)
        return delta.mul_(self.delta_scale) if self.delta_scale != 1.0 else delta

    def _idle(self, what: str) -> None:
        if self._sync is not None:
            raise RuntimeError(f"{what}() during a sync: call finish() first")

    @torch.no_grad()
    def _begin(self) -> None:
        """Steps 1-3: delta norms, ONE all_gather of the [W, U] norm matrix, then weights and drops."""
        self._idle("a new sync")
        U = len(self.units)
        norms_U = torch.stack([torch.linalg.vector_norm(self._sent_delta(k)) for k in range(U)])  # fp32
        sync = _Sync(
            weights_UW=torch.empty(0), dropped_UW=torch.empty(0), bufs=[None] * U, works=[None] * U, done=[False] * U
        )
        if self.world > 1:
            rows = [torch.empty_like(norms_U) for _ in range(self.world)]
            start = time.perf_counter()
            dist.all_gather(rows, norms_U, group=self.group)
            sync.wait_s += time.perf_counter() - start
            sync.bytes_sent += norms_U.numel() * norms_U.element_size()
            norms_UW = torch.stack(rows, dim=1)
        else:
            norms_UW = norms_U[:, None]
        sync.weights_UW, sync.dropped_UW = self._penalties(norms_UW.to(torch.float64))
        self._sync = sync

    def _penalties(self, n_UW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Anomaly elimination and norm weighting (EDiT's pseudo-gradient penalty), per unit over workers."""
        c = self.config
        mean, var, count = self.norm_mean, self.norm_var, self.norm_count
        finite = torch.isfinite(n_UW)
        if not finite.any(dim=1).all():
            raise FloatingPointError(
                "EDiT sync: every worker's pseudo-gradient is non-finite for unit "
                f"{int((~finite.any(dim=1)).nonzero()[0])}"
            )
        z = (n_UW - mean) / torch.sqrt(var + (STD_FLOOR * mean) ** 2 + TINY)
        anomalous = ~finite | ((count >= c.anomaly_warmup) & (z > c.anomaly_threshold))
        # A worker that took no local step since the last sync (a slow one at a time-based sync, or at the
        # final sync) has an exactly zero delta: nothing to merge. Under softmax(-norm) it would get the largest
        # weight and pull the average back towards the anchor, so it takes no part (and leaves the statistics).
        empty = n_UW == 0
        kept = ~anomalous & ~empty
        # A unit where every worker is anomalous keeps all (finite) workers: a rise shared by all of them is
        # a change in training (LR warm-up, new data), not one bad worker, and with nobody kept there would
        # be nothing to average; their norms also enter the statistics, which could never catch up otherwise.
        everyone = ~kept.any(dim=1, keepdim=True)
        kept = torch.where(everyone, finite, kept)
        # EMA of the mean and variance (the incremental form of West 1979, as in spike.py):
        #   mean += a * (n - mean);  var = (1 - a) * (var + a * (n - mean_old)^2)
        # with a = max(alpha, 1 / (count + 1)): the first norms give the plain running mean and variance
        # instead of an EMA biased towards its zero start, which would flag everyone right after warm-up.
        a = torch.clamp(1.0 / (count + 1).to(torch.float64), min=c.anomaly_alpha)
        d = torch.where(kept, n_UW - mean, 0.0)
        mean.add_(torch.where(kept, a * d, 0.0))
        var.copy_(torch.where(kept, (1 - a) * (var + a * d * d), var))
        count.add_(kept.to(torch.int64))
        logits = torch.where(kept, -n_UW / c.weight_temperature, -math.inf)
        return torch.softmax(logits, dim=1), ~kept & ~empty

    def _launch_through(self, last: int) -> None:
        """Start the weighted-delta all_reduce of every unit up to ``last``, always in unit order (collectives
        must be issued in the same order on every worker)."""
        sync = self._sync
        assert sync is not None
        while sync.launched <= min(last, len(self.units) - 1):
            k = sync.launched
            w = sync.weights_UW[k, self.rank].to(torch.float32)
            # A dropped delta is replaced by zeros, not multiplied by 0: 0 * inf or NaN would poison the sum.
            buf = torch.zeros_like(self.anchor[k]) if w == 0 else self._sent_delta(k).mul_(w)  # [N] fp32
            if self.world > 1:
                sync.works[k] = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                sync.bytes_sent += buf.numel() * buf.element_size()
            sync.bufs[k] = buf
            sync.launched += 1

    def _pre_hook(self, k: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._advance(k)
            self._hooks[k].remove()

        return hook

    def _advance(self, k: int) -> None:
        """Prefetch unit k+1, then complete unit k (steps 4-5); the sync ends with its last unit."""
        sync = self._sync
        if sync is None or sync.done[k]:
            return
        self._launch_through(k + 1)
        self._complete(k)
        if all(sync.done):
            self.syncs += 1
            self.last = SyncStats(
                sync=self.syncs,
                weights=sync.weights_UW.tolist(),
                dropped=sync.dropped_UW.sum(dim=0).tolist(),
                bytes_sent=sync.bytes_sent,
                wait_s=sync.wait_s,
                delta_norms=sync.delta_norms,
                clipped=sync.clipped,
            )
            self._sync = None

    @torch.no_grad()
    def _complete(self, k: int) -> None:
        sync = self._sync
        assert sync is not None
        if sync.works[k] is not None:
            start = time.perf_counter()
            sync.works[k].wait()
            sync.wait_s += time.perf_counter() - start
        g, sync.bufs[k], sync.works[k] = sync.bufs[k], None, None  # [N] fp32: the averaged pseudo-gradient
        assert g is not None
        c = self.config
        norm = torch.linalg.vector_norm(g)
        if c.clip_norm is not None and norm > c.clip_norm:
            # The 1e-6 (as in clip_grad_norm_) keeps rounding from leaving the norm just above the cap.
            g.mul_(c.clip_norm / (norm + 1e-6))
            norm = torch.linalg.vector_norm(g)
            sync.clipped += 1
        sync.delta_norms.append(float(norm))
        # Outer SGD with Nesterov momentum: m = mu * m + g; update = g + mu * m.
        m, mu = self.momentum[k], c.outer_momentum
        m.mul_(mu).add_(g)
        update = g.add(m, alpha=mu) if mu else g
        # theta_i + (delta_i - lr * update) equals anchor - lr * update in exact arithmetic; written this way,
        # one worker with lr 1 and no momentum gets its own parameters back bit for bit. The anchor itself is
        # anchor - lr * update, computed from replicated values only, so it stays identical on every worker
        # while the parameters may differ by rounding; the next deltas are measured from that common anchor.
        theta = self._flat(k)
        theta += self._delta(k).sub_(update, alpha=c.outer_lr)
        offset = 0
        for p in self.units[k][1]:
            p.copy_(theta[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.anchor[k].sub_(update, alpha=c.outer_lr)
        sync.done[k] = True


def _check_units(units: list[Unit]) -> None:
    if not units:
        raise ValueError("EDiT needs at least one unit")
    owner: dict[int, int] = {}
    for k, (module, params) in enumerate(units):
        if not params:
            raise ValueError(f"EDiT unit {k} ({type(module).__name__}) has no parameters")
        for p in params:
            if id(p) in owner:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in EDiT units {owner[id(p)]} and {k} "
                    "(tied weights belong to one unit only)"
                )
            owner[id(p)] = k
    for k, (module, _) in enumerate(units):
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in owner:
                raise ValueError(f"parameter {name!r} of EDiT unit {k} ({type(module).__name__}) is in no unit")
