"""Health warnings of a run: an MoE layer whose experts stop sharing the work, a worker slower than the rest.

**Routing.**
Ling's report watches expert load for the same reason as its balance loss: a router that sends most tokens to
a few experts wastes the others and destabilises training. Judged over a window of steps, on the summed
per-expert token counts (a single step of a small batch is too noisy): a layer is unhealthy when the counts'
coefficient of variation passes ``routing_cv``, when its busiest expert gets ``routing_max_over_mean`` times
the mean, or when an expert got no token at all in the whole window (a dead expert). Each layer is reported
once when it turns unhealthy, and again only after it has recovered and turned unhealthy anew.

**Stragglers** (synchronous workers): every worker's busy time per step (its step minus its waits for the
others), split into reading the batch (``data``), forward/backward/update (``compute``) and the rest of its
loop (``other``: host work, logging, a drill's sleep). Over ``straggler_window`` steps, a worker whose mean
busy time exceeds ``straggler_ratio`` times the median of the others' is reported, with the part that
exceeds the others' median by the most as its category. In a synchronous job the others wait for it at
every step, so its slowness is the job's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from lingctl.runs.train_config import HealthConfig


@dataclass(kw_only=True, slots=True)
class RoutingWarning:
    layer: int  # the decoder layer's index in the model
    cv: float
    max_over_mean: float
    dead_experts: list[int]
    window_steps: int
    window_s: float  # how long the window took: the unhealthy routing went on at least this long

    def reason(self) -> str:
        parts = []
        if self.dead_experts:
            parts.append(f"{len(self.dead_experts)} expert(s) got no token")
        parts.append(f"load cv {self.cv:.2f}, busiest expert {self.max_over_mean:.2f}x the mean")
        return f"layer {self.layer}: " + ", ".join(parts) + f" over the last {self.window_steps} steps"


class RoutingHealth:
    def __init__(self, config: HealthConfig, layers: list[int], num_experts: int) -> None:
        self.config = config
        self.layers = layers  # decoder layer index of each MoE layer, in routing order
        self.num_experts = num_experts
        self._counts: deque[tuple[float, torch.Tensor]] = deque(maxlen=config.routing_window)  # (time, [L, E])
        self._flagged: set[int] = set()

    def observe(self, when: float, routes: list[Any]) -> list[RoutingWarning]:
        """One applied step's routing decisions (``RouterOutput`` per MoE layer); warnings that start now."""
        if not routes:
            return []
        counts = torch.stack(
            [torch.bincount(r.topk_idx_TK.reshape(-1), minlength=self.num_experts) for r in routes]
        ).to(torch.float64)
        self._counts.append((when, counts))
        if len(self._counts) < self.config.routing_window:
            return []
        total = torch.stack([c for _, c in self._counts]).sum(dim=0)  # [L, E]
        mean = total.mean(dim=1)
        cv = total.std(dim=1, unbiased=False) / mean
        max_over_mean = total.max(dim=1).values / mean
        started = []
        for i, layer in enumerate(self.layers):
            dead = [int(e) for e in torch.nonzero(total[i] == 0).flatten()]
            bad = (
                float(cv[i]) > self.config.routing_cv
                or float(max_over_mean[i]) >= self.config.routing_max_over_mean
                or bool(dead)
            )
            if bad and layer not in self._flagged:
                self._flagged.add(layer)
                started.append(
                    RoutingWarning(
                        layer=layer,
                        cv=round(float(cv[i]), 4),
                        max_over_mean=round(float(max_over_mean[i]), 4),
                        dead_experts=dead,
                        window_steps=len(self._counts),
                        window_s=round(when - self._counts[0][0], 3),
                    )
                )
            elif not bad:
                self._flagged.discard(layer)
        return started

    def reset(self) -> None:
        """After a rollback: the window's steps were abandoned (a layer already reported stays reported)."""
        self._counts.clear()


@dataclass(kw_only=True, slots=True)
class StragglerWarning:
    rank: int
    category: str  # data, compute or other
    busy_s: float  # its mean busy time per step over the window
    others_busy_s: float  # the median of the other workers' means
    parts_s: dict[str, float]  # its mean time per part
    others_parts_s: dict[str, float]
    window_steps: int
    window_s: float

    def reason(self) -> str:
        return (
            f"worker {self.rank} takes {self.busy_s * 1e3:.0f} ms per step against {self.others_busy_s * 1e3:.0f} ms "
            f"for the others ({self.busy_s / max(self.others_busy_s, 1e-9):.1f}x), most of it in {self.category}"
        )


class StragglerWatch:
    def __init__(self, config: HealthConfig, world: int) -> None:
        self.config = config
        self.world = world
        self._rows: deque[tuple[float, torch.Tensor]] = deque(maxlen=config.straggler_window)  # (time, [W, 3])
        self._flagged: set[int] = set()

    def observe(self, when: float, busy: Any, data: Any, compute: Any) -> list[StragglerWarning]:
        """One step's per-worker figures (seconds, rank order); warnings that start now."""
        busy_t, data_t, compute_t = (torch.as_tensor(x, dtype=torch.float64) for x in (busy, data, compute))
        other_t = (busy_t - data_t - compute_t).clamp(min=0.0)
        self._rows.append((when, torch.stack([busy_t, data_t, compute_t, other_t], dim=1)))
        if len(self._rows) < self.config.straggler_window or self.world < 2:
            return []
        mean = torch.stack([r for _, r in self._rows]).mean(dim=0)  # [W, 4]: busy, data, compute, other
        started = []
        for rank in range(self.world):
            others = torch.cat([mean[:rank], mean[rank + 1 :]])
            median = others.median(dim=0).values
            slow = float(mean[rank, 0]) > self.config.straggler_ratio * float(median[0])
            if slow and rank not in self._flagged:
                self._flagged.add(rank)
                names = ("data", "compute", "other")
                excess = [float(mean[rank, i + 1] - median[i + 1]) for i in range(3)]
                started.append(
                    StragglerWarning(
                        rank=rank,
                        category=names[max(range(3), key=lambda i: excess[i])],
                        busy_s=round(float(mean[rank, 0]), 4),
                        others_busy_s=round(float(median[0]), 4),
                        parts_s={n: round(float(mean[rank, i + 1]), 4) for i, n in enumerate(names)},
                        others_parts_s={n: round(float(median[i + 1]), 4) for i, n in enumerate(names)},
                        window_steps=len(self._rows),
                        window_s=round(when - self._rows[0][0], 3),
                    )
                )
            elif not slow:
                self._flagged.discard(rank)
        return started
