"""``lingctl train`` settings: one typed config, from a preset's defaults, a TOML file and flags.

The whole config is saved with every checkpoint, so a run can be resumed or inspected from its directory alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from lingctl.core.config import from_mapping
from lingctl.core.errors import UsageError
from lingctl.model.config import LingConfig
from lingctl.model.presets import preset
from lingctl.train.edit import EditConfig
from lingctl.train.spike import SpikeConfig


@dataclass(kw_only=True, slots=True)
class DataConfig:
    # Text files, directories, globs or JSONL files; empty = the Python standard library's sources.
    paths: list[str] = field(default_factory=list)
    # An existing tokenizer.json; None = train a byte-level BPE on the corpus (saved in the run directory).
    tokenizer: str | None = None
    vocab_size: int | None = None  # None = the preset's
    text_field: str = "text"  # JSONL field holding the document
    eval_fraction: float = 0.02
    # Caps how much text is read; the default corpus is capped so that setup takes seconds.
    max_bytes: int | None = None


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float | None = None  # None = the preset's
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass(kw_only=True, slots=True)
class MoeLossConfig:
    balance_coef: float = 0.01  # alpha of the load-balance loss
    z_coef: float = 0.001  # router z-loss coefficient
    routing_warmup_steps: int = 20  # stochastic routing warmup length (0 = off)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    preset: str = "small"
    # Changes to the preset's model shape, with config.json names: {num_hidden_layers = 2}.
    model: dict[str, Any] = field(default_factory=dict)
    steps: int = 200
    batch_size: int | None = None  # sequences per step; None = the preset's
    batch_warmup_steps: int = 0
    batch_start: int = 1
    seq_len: int | None = None  # None = the preset's
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16 = autocast; master weights stay float32
    dispatch: Literal["naive", "sorted", "grouped"] = "sorted"
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 50
    keep_checkpoints: int = 2
    max_seconds: float | None = None
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    moe: MoeLossConfig = field(default_factory=MoeLossConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    # Fault drill: at these attempts the loss is multiplied by `inject_spike_factor` (tests, benchmarks).
    inject_spikes: list[int] = field(default_factory=list)
    inject_spike_factor: float = 10.0
    # Fault drill: the process kills itself (SIGKILL) right after this step, before any later checkpoint.
    # Not inherited by a resumed run. With several workers, only worker `crash_rank` does.
    crash_at_step: int | None = None
    crash_rank: int = 0
    # Several workers (--nproc N, or torchrun): "ddp" = synchronous data parallel (DistributedDataParallel);
    # "edit" = EDiT local SGD: local AdamW steps, a penalised pseudo-gradient average every sync.
    sync: Literal["ddp", "edit"] = "ddp"
    sync_every: int = 10  # edit: local steps between syncs
    sync_every_seconds: float | None = None  # edit: sync by time instead; faster workers take more steps
    edit_warmup_steps: int = 0  # edit: synchronous steps (gradients averaged) before local SGD starts
    edit: EditConfig = field(default_factory=EditConfig)
    # Fault drills: worker `simulate_slow_rank` runs `slowdown` times slower (it sleeps after each step);
    # worker `simulate_bad_rank` sends a corrupted update (pseudo-gradient or gradient x100).
    simulate_slow_rank: int | None = None
    slowdown: float = 1.0
    simulate_bad_rank: int | None = None

    def validate(self) -> None:
        for name in ("steps", "eval_batches", "keep_checkpoints", "batch_start"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("eval_every", "save_every", "batch_warmup_steps"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.seq_len is not None and self.seq_len < 2:
            raise UsageError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise UsageError(f"max_seconds must be positive, got {self.max_seconds}")
        if not 0.0 <= self.data.eval_fraction < 1.0:
            raise UsageError(f"data.eval_fraction must be in [0, 1), got {self.data.eval_fraction}")
        try:
            self.spike.validate()
            self.edit.validate()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if self.sync not in ("ddp", "edit"):
            raise UsageError(f"sync must be ddp or edit, got {self.sync!r}")
        if self.sync_every < 1:
            raise UsageError(f"sync_every must be at least 1, got {self.sync_every}")
        if self.sync_every_seconds is not None and not self.sync_every_seconds > 0:
            raise UsageError(f"sync_every_seconds must be positive, got {self.sync_every_seconds}")
        if self.edit_warmup_steps < 0:
            raise UsageError(f"edit_warmup_steps must be >= 0, got {self.edit_warmup_steps}")
        if self.slowdown < 1:
            raise UsageError(f"slowdown must be at least 1, got {self.slowdown}")
        preset(self.preset)  # unknown preset: one line with the choices


# Training defaults per preset: what fits the preset's purpose on the hardware it targets.
PRESET_TRAINING: dict[str, dict[str, Any]] = {
    "tiny": {"seq_len": 64, "batch_size": 8, "lr": 3e-3, "vocab_size": 1024},
    "small": {"seq_len": 256, "batch_size": 8, "lr": 2e-3, "vocab_size": 8192},
    "ling-lite": {"seq_len": 4096, "batch_size": 1, "lr": 3e-4, "vocab_size": None},
    "ling-plus": {"seq_len": 4096, "batch_size": 1, "lr": 3e-4, "vocab_size": None},
}


@dataclass(kw_only=True, slots=True)
class Resolved:
    """A TrainConfig with every preset default filled in."""

    seq_len: int
    batch_size: int
    lr: float
    vocab_size: int | None  # tokenizer vocabulary to train; None = the model's


def resolve(config: TrainConfig) -> Resolved:
    d = PRESET_TRAINING[config.preset]
    return Resolved(seq_len=config.seq_len or d["seq_len"], batch_size=config.batch_size or d["batch_size"],
                    lr=config.optim.lr or d["lr"], vocab_size=config.data.vocab_size or d["vocab_size"])


def model_config(config: TrainConfig, *, vocab_size: int, eos_id: int, seq_len: int) -> LingConfig:
    """The preset's shape with the run's changes; tiny/small take the tokenizer's vocabulary, while the
    published Ling shapes keep theirs (the tokenizer must fit in it)."""
    base = dataclasses.asdict(preset(config.preset))
    if config.preset in ("tiny", "small"):
        base["vocab_size"] = vocab_size
    base["pad_token_id"] = base["eos_token_id"] = eos_id
    base["max_position_embeddings"] = max(base["max_position_embeddings"], seq_len)
    unknown = sorted(set(config.model) - set(base))
    if unknown:
        raise UsageError(f"unknown model field {unknown[0]!r}", hint="use config.json names, e.g. model.num_hidden_layers=2")
    base.update(config.model)
    model = from_mapping(LingConfig, base, where="model settings")
    model.validate()
    if vocab_size > model.vocab_size:
        raise UsageError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {model.vocab_size}")
    return model
