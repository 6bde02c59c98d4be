"""A hyper-parameter sweep's spec (``[sweep]`` in a TOML file) and the points it expands to.

Each point is one ordinary ``lingctl train`` run: a model family (``moe``: the preset's shape; ``dense``: the same
shape with every layer a dense MLP, as wide as makes the active parameters equal), a compute budget, a learning rate and a batch size. Its steps follow from the budget:

    compute = 6 x active parameters x tokens        tokens = steps x batch size x seq_len

Active parameters are the matrices a token goes through: attention, the dense MLPs, the k routed and the shared
experts and the routers of MoE layers, the norms and the LM head; not the input embedding (a lookup costs no
multiply). The attention scores and their product with the values are not in the count: per token they add
12 x layers x seq_len x (heads x head_dim) FLOPs (forward and backward), reported per sweep as ``attention_share``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from lingctl.core.config import from_mapping
from lingctl.core.errors import UsageError
from lingctl.model.config import LingConfig
from lingctl.model.presets import preset

FAMILIES = ("moe", "dense")
MIN_STEPS = 10


@dataclass(kw_only=True, slots=True)
class SweepSpec:
    preset: str = "tiny"
    families: list[str] = field(default_factory=lambda: ["moe"])
    budgets: list[float] = field(default_factory=list)  # FLOPs
    lrs: list[float] = field(default_factory=list)  # the learning-rate grid
    batch_sizes: list[int] = field(default_factory=list)  # sequences per step
    seq_len: int = 64
    model: dict[str, Any] = field(default_factory=dict)  # changes to the preset's shape, config.json names
    # Model sizes per budget: further changes on top of `model`, e.g. [{hidden_size = 48}, {hidden_size = 96,
    # num_hidden_layers = 3}]; each budget trains every size (fewer tokens for the larger ones).
    sizes: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    data: list[str] = field(default_factory=list)  # --data of every point; empty: the built-in corpus
    max_bytes: int | None = None  # caps the data read (data.max_bytes)
    vocab_size: int = 1024  # the sweep's one tokenizer
    eval_rows: int = 256  # every point evaluates on the same first rows of the held-out split
    warmup_fraction: float = 0.1  # of each point's steps
    seed: int = 0
    parallel: int = 1  # points run at once; each gets cores // parallel threads

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise UsageError(f"sweep spec: {what}")

        preset(self.preset)
        need(bool(self.families) and set(self.families) <= set(FAMILIES), f"families must be among {FAMILIES}")
        need(len(self.budgets) >= 1 and all(b > 0 and math.isfinite(b) for b in self.budgets), "budgets > 0")
        need(len(self.lrs) >= 1 and all(0 < x < 1 for x in self.lrs), "lrs in (0, 1)")
        need(len(self.batch_sizes) >= 1 and all(b >= 1 for b in self.batch_sizes), "batch_sizes >= 1")
        need(self.seq_len >= 2 and self.parallel >= 1 and 0 <= self.warmup_fraction < 1, "seq_len, parallel")
        need(len(self.sizes) >= 1 and all(isinstance(x, dict) for x in self.sizes), "sizes: a list of tables")

    def digest(self) -> str:
        """Identifies the experiment: a sweep directory holds the results of one spec only."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(kw_only=True, slots=True)
class Point:
    id: str
    family: str
    budget: float
    lr: float
    batch_size: int
    steps: int
    seq_len: int
    warmup_steps: int
    active_parameters: int
    model: dict[str, Any]

    @property
    def compute(self) -> float:
        """The FLOPs the point trains with (its steps are whole, so close to its budget, not equal)."""
        return 6.0 * self.active_parameters * self.steps * self.batch_size * self.seq_len


def read_spec(table: dict[str, Any], where: str) -> SweepSpec:
    spec = from_mapping(SweepSpec, table, where=where)
    spec.validate()
    return spec


def family_model(spec: SweepSpec, family: str, size: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model changes of a family at a size: ``dense`` makes every layer a dense MLP of one width that keeps
    the active parameters of the MoE shape."""
    changes = {**spec.model, **(size or {})}
    if family == "dense":
        shape = shape_of(spec, changes)
        active = (shape.num_experts_per_tok + shape.num_shared_experts) * shape.moe_intermediate_size
        # One width for every layer: the mean of the MoE model's dense layers and its active expert width, so the
        # two families have the same active parameters (the routers' few aside).
        k, layers = shape.first_k_dense_replace, shape.num_hidden_layers
        width = round((k * (shape.intermediate_size or 0) + (layers - k) * active) / layers)
        changes.update(first_k_dense_replace=layers, intermediate_size=width)
    return changes


def shape_of(spec: SweepSpec, changes: dict[str, Any]) -> LingConfig:
    base = dataclasses.asdict(preset(spec.preset))
    base["vocab_size"] = spec.vocab_size
    base.update(changes)
    shape = from_mapping(LingConfig, base, where="sweep model")
    shape.validate()
    return shape


def active_parameters(shape: LingConfig) -> int:
    """Active parameters without the input embedding (see the module docstring)."""
    return shape.num_parameters(active=True) - shape.vocab_size * shape.hidden_size


def attention_share(shape: LingConfig, seq_len: int) -> float:
    """What the attention products add to 6 x active parameters per token, as a fraction of it (average over a
    causal sequence: half of seq_len keys per query)."""
    extra = 12 * shape.num_hidden_layers * (seq_len / 2) * shape.num_attention_heads * shape.head_dim
    return extra / (6 * active_parameters(shape))


def points(spec: SweepSpec) -> list[Point]:
    """Every (family, budget, lr, batch size) of the spec with at least MIN_STEPS steps, in a fixed order."""
    out = []
    for family, (k, size) in itertools.product(spec.families, enumerate(spec.sizes)):
        changes = family_model(spec, family, size)
        n = active_parameters(shape_of(spec, changes))
        tag = f"-s{k}" if len(spec.sizes) > 1 else ""
        for budget in spec.budgets:
            for batch in spec.batch_sizes:
                steps = round(budget / (6 * n * batch * spec.seq_len))
                if steps < MIN_STEPS:
                    continue
                for lr in spec.lrs:
                    pid = f"{family}{tag}-c{budget:.2e}-lr{lr:.2e}-b{batch}".replace("+", "")
                    out.append(
                        Point(
                            id=pid, family=family, budget=budget, lr=lr, batch_size=batch, steps=steps, seq_len=spec.seq_len,
                            warmup_steps=max(1, int(steps * spec.warmup_fraction)), active_parameters=n,
                            model=changes,
                        )
                    )  # fmt: skip
    if not out:
        raise UsageError("sweep spec: no point has enough steps", hint="raise the budgets or lower the batch sizes")
    return out


# The worked example of docs/train.md: three budgets, MoE against dense of the same active size, a 5 x 3 grid of
# learning rates and batch sizes (90 points, 27M tokens); about 15 minutes on 2 CPU cores. Small models take
# large learning rates: a first try with 1e-3..1e-2 had its optima at the grid's edge.
BUILTIN: dict[str, Any] = {
    "preset": "tiny",
    "families": ["moe", "dense"],
    "budgets": [5e10, 1.5e11, 5e11],
    "lrs": [3e-3, 6e-3, 1.2e-2, 2.4e-2, 4.8e-2],
    "batch_sizes": [4, 8, 16],
    "seq_len": 64,
    # Models this small gain little from a second thread: two points at once, one core each.
    "parallel": 2,
}
