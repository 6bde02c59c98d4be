"""How much memory a training run needs per worker, known before anything is written: ``train --dry-run`` prints
it, and a real run that cannot fit is refused before its run directory is made (as ``flood run`` refuses a
model that cannot fit before reading a weight).

Per worker (each DDP or EDiT worker holds the whole model):

- weights: float32 master weights (``--dtype bfloat16`` is autocast: the weights stay float32);
- gradients: float32, one per weight;
- optimizer: AdamW's two float32 moments per weight;
- activations kept for the backward pass, per token and layer: the attention block's inputs and outputs (norm,
  q, k, v, attention and projection outputs, residual) and the MoE block's (norm, router scores, and for each of
  the k routed and the shared experts its gathered input, gate, up and SwiGLU rows); then the logits and their
  gradient in float32. Float32 runs keep 4 bytes per value, bfloat16 autocast about 2; the total is taken 1.25x
  for the temporaries of the step (an estimate: the allocator and the kernels' scratch vary);
- the runtime: the interpreter, torch and the data pipeline, about 0.6 GiB.

The workers on this machine share its memory: what is available is the smaller of the system's available memory
and what the process's cgroup (a container's or a job's memory limit) still allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from lingctl.core.errors import LingctlError
from lingctl.core.units import format_params, format_size
from lingctl.model.config import LingConfig

RUNTIME_BYTES = int(0.6 * 2**30)
TEMPORARIES = 1.25  # activations and logits, times this: the step's own temporaries


@dataclass(kw_only=True, slots=True)
class TrainMemoryPlan:
    params: int
    active_params: int
    batch_size: int
    seq_len: int
    dtype: str
    workers: int  # on this machine
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    runtime_bytes: int
    per_worker_bytes: int
    total_bytes: int  # every worker on this machine
    available_bytes: int

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes

    def lines(self) -> list[str]:
        """The plan as a person reads it."""
        f = format_size
        return [
            f"model: {format_params(self.params)} parameters ({format_params(self.active_params)} active); batch "
            f"{self.batch_size} x {self.seq_len} tokens, {self.dtype}, {self.workers} worker(s) on this machine",
            f"memory plan per worker: {f(self.per_worker_bytes)} = weights {f(self.weights_bytes)} + gradients "
            f"{f(self.grads_bytes)} + AdamW {f(self.optimizer_bytes)} + activations {f(self.activation_bytes)} "
            f"+ runtime {f(self.runtime_bytes)}",
            f"this machine: {f(self.total_bytes)} needed, {f(self.available_bytes)} available"
            + ("" if self.fits else " - it does not fit"),
        ]

    def refusal(self) -> LingctlError:
        return LingctlError(
            f"the run needs {format_size(self.total_bytes)} ({self.workers} worker(s) x "
            f"{format_size(self.per_worker_bytes)}: weights, gradients and AdamW {format_size(self.state_bytes)}, "
            f"activations {format_size(self.activation_bytes)}); {format_size(self.available_bytes)} is available; "
            "nothing was written",
            hint="lower --batch-size or --seq-len, fewer workers (--nproc), or a smaller preset; "
            "lingctl train --dry-run shows the plan",
        )

    @property
    def state_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes


def activation_bytes(config: LingConfig, *, batch_size: int, seq_len: int, dtype: str) -> int:
    """What the forward pass keeps for the backward pass at this batch (see the module docstring)."""
    c = config
    d, tokens = c.hidden_size, batch_size * seq_len
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    attention = 3 * d + qkv + 2 * c.num_attention_heads * c.head_dim
    moe = d + 2 * c.num_experts + (c.num_experts_per_tok + c.num_shared_experts) * (d + 3 * c.moe_intermediate_size)
    dense = d + 3 * (c.intermediate_size or 0)
    n_dense = min(c.first_k_dense_replace, c.num_hidden_layers)
    per_token = c.num_hidden_layers * attention + n_dense * dense + (c.num_hidden_layers - n_dense) * moe
    value = 4 if dtype == "float32" else 2
    logits = 2 * 4 * c.vocab_size  # float32 logits and their gradient
    return int(TEMPORARIES * tokens * (per_token * value + logits))


def available_memory() -> int:
    """The smaller of the system's available memory and what this process's cgroup v2 limit still allows."""
    available = int(psutil.virtual_memory().available)
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _cgroup_room() -> int | None:
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()
        path = next((ln.split(":", 2)[2] for ln in line if ln.startswith("0::")), None)
        if path is None:
            return None
        base = Path("/sys/fs/cgroup") / path.lstrip("/")
        room: int | None = None
        for d in (base, *base.parents):  # a parent's limit binds too
            if not str(d).startswith("/sys/fs/cgroup"):
                break
            try:
                limit = (d / "memory.max").read_text().strip()
                current = int((d / "memory.current").read_text().strip())
            except (OSError, ValueError):
                continue
            if limit != "max":
                left = max(0, int(limit) - current)
                room = left if room is None else min(room, left)
        return room
    except (OSError, ValueError, IndexError):
        return None


def plan_training(
    config: LingConfig, *, batch_size: int, seq_len: int, dtype: str, workers: int, available: int | None = None
) -> TrainMemoryPlan:
    params = config.num_parameters()
    weights = 4 * params
    acts = activation_bytes(config, batch_size=batch_size, seq_len=seq_len, dtype=dtype)
    per_worker = weights + weights + 2 * weights + acts + RUNTIME_BYTES
    return TrainMemoryPlan(
        params=params,
        active_params=config.num_parameters(active=True),
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=dtype,
        workers=workers,
        weights_bytes=weights,
        grads_bytes=weights,
        optimizer_bytes=2 * weights,
        activation_bytes=acts,
        runtime_bytes=RUNTIME_BYTES,
        per_worker_bytes=per_worker,
        total_bytes=workers * per_worker,
        available_bytes=available_memory() if available is None else available,
    )
