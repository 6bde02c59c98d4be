"""Loss-spike guard: do not apply an update whose loss or gradient norm is far above its running average.

Ling's report handles spikes by skipping the offending step and retrying its data later, and by lowering
the learning rate when spikes keep coming. The guard keeps an exponential moving average (EMA) of the loss
and of the gradient norm with their variances; a value is a spike only when it is both many standard
deviations above the EMA (z-test) and a clear multiple of it (ratio test), so a run whose loss is very
stable does not flag ordinary noise. Spiking values never enter the averages.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lingctl.runs.train_config import SpikeConfig


@dataclass(slots=True)
class _Ema:
    mean: float = 0.0
    var: float = 0.0
    count: int = 0

    def update(self, x: float, beta: float) -> None:
        if self.count == 0:
            self.mean, self.var = x, 0.0
        else:
            delta = x - self.mean
            self.mean += (1 - beta) * delta
            self.var = beta * (self.var + (1 - beta) * delta * delta)
        self.count += 1

    def z(self, x: float) -> float:
        # A floor on the deviation: a perfectly flat history must not make every wiggle infinite.
        std = max(math.sqrt(self.var), 1e-3 * abs(self.mean), 1e-8)
        return (x - self.mean) / std


@dataclass(slots=True)
class Verdict:
    spike: bool
    reason: str = ""


@dataclass(kw_only=True, slots=True)
class SpikeGuard:
    config: SpikeConfig
    loss: _Ema = field(default_factory=_Ema)
    grad: _Ema = field(default_factory=_Ema)
    lr_scale: float = 1.0
    spike_steps: list[int] = field(default_factory=list)  # steps of recent spikes, for the window rule
    total_spikes: int = 0
    lr_drops: int = 0

    def _armed(self) -> bool:
        return self.config.enabled and self.loss.count >= self.config.warmup_steps

    def check_loss(self, loss: float) -> Verdict:
        c = self.config
        if not math.isfinite(loss):  # never applied, guard or not: one such update ruins the weights
            return Verdict(True, f"loss is {loss}")
        if self._armed() and self.loss.z(loss) > c.loss_z and loss > c.loss_ratio * self.loss.mean:
            return Verdict(True, f"loss {loss:.4g} vs EMA {self.loss.mean:.4g} (z={self.loss.z(loss):.1f})")
        return Verdict(False)

    def check_grad(self, grad_norm: float) -> Verdict:
        c = self.config
        if not math.isfinite(grad_norm):
            return Verdict(True, f"gradient norm is {grad_norm}")
        if (
            self._armed()
            and self.grad.count >= c.warmup_steps
            and self.grad.z(grad_norm) > c.grad_z
            and grad_norm > c.grad_ratio * self.grad.mean
        ):
            return Verdict(
                True, f"grad norm {grad_norm:.4g} vs EMA {self.grad.mean:.4g} (z={self.grad.z(grad_norm):.1f})"
            )
        return Verdict(False)

    def accept(self, loss: float, grad_norm: float) -> None:
        """An applied step: its values join the averages."""
        self.loss.update(loss, self.config.ema_beta)
        self.grad.update(grad_norm, self.config.ema_beta)

    def record_spike(self, step: int) -> bool:
        """Count a skipped step; True when this spike lowered the learning rate."""
        c = self.config
        self.total_spikes += 1
        self.spike_steps = [s for s in self.spike_steps if s > step - c.window_steps] + [step]
        if len(self.spike_steps) >= c.max_spikes and self.lr_scale > c.min_lr_scale:
            self.lr_scale = max(c.min_lr_scale, self.lr_scale * c.lr_factor)
            self.lr_drops += 1
            self.spike_steps = []
            return True
        return False

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": asdict(self.loss),
            "grad": asdict(self.grad),
            "lr_scale": self.lr_scale,
            "spike_steps": list(self.spike_steps),
            "total_spikes": self.total_spikes,
            "lr_drops": self.lr_drops,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss = _Ema(**state["loss"])
        self.grad = _Ema(**state["grad"])
        self.lr_scale = float(state["lr_scale"])
        self.spike_steps = [int(s) for s in state["spike_steps"]]
        self.total_spikes = int(state["total_spikes"])
        self.lr_drops = int(state["lr_drops"])
