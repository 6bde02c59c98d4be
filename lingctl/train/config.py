"""``lingctl train`` settings: one typed config, from a preset's defaults, a TOML file and flags.

The whole config is saved with every checkpoint, so a run can be resumed or inspected from its directory alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lingctl.core.config import from_mapping
from lingctl.core.errors import UsageError
from lingctl.core.units import parse_size
from lingctl.model.config import LingConfig
from lingctl.model.hf_files import DEFAULT_MAX_SHARD_SIZE, LING_CODE_REPO
from lingctl.model.presets import preset
from lingctl.train.edit import EditConfig
from lingctl.train.spike import SpikeConfig

Check = tuple[Callable[[Any], bool], str]  # (predicate, the rule in words)


def _whole(low: int, high: int | None = None) -> Check:
    rule = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    return (lambda v: v >= low and (high is None or v <= high)), rule


def _number(low: float, high: float = math.inf, *, above: bool = False, below: bool = False) -> Check:
    """A finite number in [low, high]; ``above`` / ``below`` exclude the bound itself."""

    def ok(v: float) -> bool:
        return math.isfinite(v) and (v > low if above else v >= low) and (v < high if below else v <= high)

    if math.isinf(high):
        return ok, f"a finite number {'>' if above else '>='} {low:g}"
    return ok, f"a number in {'(' if above else '['}{low:g}, {high:g}{')' if below else ']'}"


# The command-line flag of a setting, named in its error so that `--lr nan` is answered in the user's terms.
FLAGS = {
    "steps": "--steps",
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "seed": "--seed",
    "eval_every": "--eval-every",
    "save_every": "--save-every",
    "max_seconds": "--max-seconds",
    "max_consecutive_skips": "--max-consecutive-skips",
    "sync_every": "--sync-every",
    "sync_every_seconds": "--sync-every-seconds",
    "simulate_slow_rank": "--simulate-slow-rank",
    "slowdown": "--slowdown",
    "simulate_bad_rank": "--simulate-bad-rank",
    "optim.lr": "--lr",
}


def check_ranges(obj: Any, rules: Mapping[str, Check], prefix: str = "") -> None:
    """``UsageError`` naming the first field of ``obj`` outside its range (None means "the default": skipped).

    Numbers that cannot work are refused here, before any data is read: a NaN or infinite learning rate
    would otherwise train for ever on skipped steps, a negative one would climb the loss."""
    for name, (ok, rule) in rules.items():
        value = getattr(obj, name)
        if value is None or ok(value):
            continue
        path = prefix + name
        shown = f"{path} ({FLAGS[path]})" if path in FLAGS else path
        raise UsageError(f"{shown} must be {rule}, got {value!r}")


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

    def validate(self) -> None:
        check_ranges(
            self, {"vocab_size": _whole(1), "eval_fraction": _number(0, 1, below=True), "max_bytes": _whole(1)}, "data."
        )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float | None = None  # None = the preset's
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping

    def validate(self) -> None:
        check_ranges(
            self,
            {
                "lr": _number(0, above=True),
                "min_lr_ratio": _number(0, 1),
                "warmup_steps": _whole(0),
                "weight_decay": _number(0),
                "beta1": _number(0, 1, below=True),
                "beta2": _number(0, 1, below=True),
                "eps": _number(0, above=True),
                "grad_clip": _number(0),
            },
            "optim.",
        )


@dataclass(kw_only=True, slots=True)
class MoeLossConfig:
    balance_coef: float = 0.01  # alpha of the load-balance loss
    z_coef: float = 0.001  # router z-loss coefficient
    routing_warmup_steps: int = 20  # stochastic routing warmup length (0 = off)

    def validate(self) -> None:
        check_ranges(
            self, {"balance_coef": _number(0), "z_coef": _number(0), "routing_warmup_steps": _whole(0)}, "moe."
        )


@dataclass(kw_only=True, slots=True)
class WatchdogConfig:
    """What the in-worker watchdog calls divergence and what a rollback does (Ling report §3: retry or skip
    wide spikes, lower the learning rate when they persist); and the routing-health warnings."""

    # This many skipped spikes within `window_steps` steps are a divergence, not noise (the spike guard's
    # own LR drop comes first, at spike.max_spikes).
    spikes: int = 6
    window_steps: int = 100
    lr_factor: float = 0.5  # each rollback multiplies the learning rate by this
    max_rollbacks: int = 3  # then the run ends with exit 1 (a give_up incident)
    # Routing health, warned about (no action) when a MoE layer passes either threshold over the last
    # `routing_window` steps on average, or has an expert that got no token in all of them (dead expert).
    routing_cv: float = 1.5
    routing_max_over_mean: float = 4.0
    routing_window: int = 20
    # A synchronous worker whose busy time per step is this many times the others' median, on average over
    # `straggler_window` steps, is reported as a straggler (warning).
    straggler_ratio: float = 1.5
    straggler_window: int = 20

    def validate(self) -> None:
        if isinstance(self.spikes, bool) or not isinstance(self.spikes, int) or self.spikes < 1:
            raise UsageError(f"watchdog_config.spikes must be an integer >= 1, got {self.spikes!r}")
        for name in ("window_steps", "routing_window", "straggler_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"watchdog_config.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_rollbacks, bool) or not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            raise UsageError(f"watchdog_config.max_rollbacks must be an integer >= 0, got {self.max_rollbacks!r}")
        if not (isinstance(self.lr_factor, (int, float)) and 0.0 < self.lr_factor < 1.0):
            raise UsageError(f"watchdog_config.lr_factor must be in (0, 1), got {self.lr_factor!r}")
        for name in ("routing_cv", "routing_max_over_mean", "straggler_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UsageError(f"watchdog_config.{name} must be a finite number > 0, got {value!r}")


def parse_pair(text: str | None, what: str) -> tuple[int, int] | None:
    """ "A:B" of two whole numbers >= 0 (the drills' RANK:STEP and STEP:COUNT)."""
    if text is None:
        return None
    parts = str(text).split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"{what} must be two whole numbers A:B, got {text!r}")
    return int(parts[0]), int(parts[1])


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    preset: str = "small"
    # Changes to the preset's model shape, with config.json names: {num_hidden_layers = 2}.
    model: dict[str, Any] = field(default_factory=dict)
    # Start from this Ling checkpoint (a directory or a Hub id, ORG/NAME[@REV]): its shape, weights and
    # tokenizer; the preset then only supplies training defaults (sequence length, batch size, learning rate).
    init_from: str | None = None
    # Checkpoint files as Hugging Face writes them: weights split into shards of at most this size, and the
    # Hub repository whose Ling code config.json's auto_map names ("" = code files beside the weights).
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE
    hf_code_repo: str = LING_CODE_REPO
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
    # This many skipped attempts in a row (spikes, non-finite loss or gradients) end the run with exit 1:
    # a diverged run would otherwise skip for ever. Enough for the spike guard's LR drops to take effect.
    max_consecutive_skips: int = 20
    # Where metrics go besides metrics.jsonl: TensorBoard event files in the run's tensorboard/ directory,
    # or Weights & Biases (the wandb package; it reads WANDB_MODE, WANDB_PROJECT and the like itself).
    report_to: Literal["none", "tensorboard", "wandb"] = "none"
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
    # The watchdog: None = on with several workers. In the workers it rolls a diverged run back to its last
    # checkpoint with a lower learning rate, skipping the data that diverged; in the launcher it restarts
    # hung and crashed jobs (see docs/train.md).
    watchdog: bool | None = None
    watchdog_config: WatchdogConfig = field(default_factory=WatchdogConfig)
    # Fault drills for the watchdog, each in the job's first attempt only (a restart or rollback does not
    # repeat it): rank R blocks for ever in a point-to-point receive at step S ("R:S"); the loss of step S
    # is NaN; N spikes in a row from step S ("S:N"); the router of MoE layer L sends every token to the
    # same experts.
    simulate_hang: str | None = None
    simulate_nan: int | None = None
    simulate_spikes: str | None = None
    simulate_routing_collapse: int | None = None

    def validate(self) -> None:
        check_ranges(self, TRAIN_RULES)
        parse_pair(self.simulate_hang, "simulate_hang (--simulate-hang RANK:STEP)")
        parse_pair(self.simulate_spikes, "simulate_spikes (--simulate-spikes STEP:COUNT)")
        if self.watchdog is not None and not isinstance(self.watchdog, bool):
            raise UsageError(f"watchdog must be true or false, got {self.watchdog!r}")
        self.watchdog_config.validate()
        if any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in self.inject_spikes):
            raise UsageError(f"inject_spikes must be a list of attempt numbers >= 0, got {self.inject_spikes!r}")
        self.data.validate()
        self.optim.validate()
        self.moe.validate()
        try:
            self.spike.validate()
            self.edit.validate()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        try:
            parse_size(self.max_shard_size)
        except UsageError:
            raise UsageError(
                f"max_shard_size (--max-shard-size) must be a size such as 5GB or 500MiB, got {self.max_shard_size!r}"
            ) from None
        if self.report_to not in REPORT_TO:
            raise UsageError(f"report_to (--report-to) must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        if self.sync not in ("ddp", "edit"):
            raise UsageError(f"sync must be ddp or edit, got {self.sync!r}")
        preset(self.preset)  # unknown preset: one line with the choices


TRAIN_RULES: dict[str, Check] = {
    # Per worker and step; the caps are far above any real run and keep a typo from allocating terabytes.
    "steps": _whole(1),
    "batch_size": _whole(1, 2**20),
    "batch_warmup_steps": _whole(0),
    "batch_start": _whole(1),
    "seq_len": _whole(2, 2**20),
    # Routing-warmup noise seeds are derived as (seed * 1e6 + attempt) * 1e3: 32 bits keep that in 64.
    "seed": _whole(0, 2**32 - 1),
    "eval_every": _whole(0),
    "eval_batches": _whole(1),
    "save_every": _whole(0),
    "keep_checkpoints": _whole(1),
    "max_seconds": _number(0, above=True),
    "max_consecutive_skips": _whole(1),
    "inject_spike_factor": _number(0, above=True),
    "crash_at_step": _whole(1),
    "crash_rank": _whole(0),
    "sync_every": _whole(1),
    "sync_every_seconds": _number(0, above=True),
    "edit_warmup_steps": _whole(0),
    # The slow worker sleeps (slowdown - 1) x its step time after each step.
    "simulate_slow_rank": _whole(0),
    "slowdown": _number(1, 1000),
    "simulate_bad_rank": _whole(0),
    "simulate_nan": _whole(1),
    "simulate_routing_collapse": _whole(0),
}


REPORT_TO = ("none", "tensorboard", "wandb")

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
    return Resolved(
        seq_len=config.seq_len or d["seq_len"],
        batch_size=config.batch_size or d["batch_size"],
        lr=config.optim.lr or d["lr"],
        vocab_size=config.data.vocab_size or d["vocab_size"],
    )


# Fields that fix a checkpoint's parameter shapes or what its weights mean: a run that starts from a
# checkpoint cannot change them.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "tie_word_embeddings",
    "use_bias",
    "use_qkv_bias",
    "norm_head",
)


def model_config(
    config: TrainConfig, *, vocab_size: int, eos_id: int, seq_len: int, init: LingConfig | None = None
) -> LingConfig:
    """The preset's shape with the run's changes; tiny/small take the tokenizer's vocabulary, while the
    published Ling shapes keep theirs (the tokenizer must fit in it).

    ``init``: the config of the checkpoint the run starts from, which then is the shape; a model setting that
    disagrees with it on a shape field is refused."""
    if init is not None:
        return _init_model_config(config, init, vocab_size=vocab_size, seq_len=seq_len)
    base = dataclasses.asdict(preset(config.preset))
    if config.preset in ("tiny", "small"):
        base["vocab_size"] = vocab_size
    base["pad_token_id"] = base["eos_token_id"] = eos_id
    base["max_position_embeddings"] = max(base["max_position_embeddings"], seq_len)
    unknown = sorted(set(config.model) - set(base))
    if unknown:
        raise UsageError(
            f"unknown model field {unknown[0]!r}", hint="use config.json names, e.g. model.num_hidden_layers=2"
        )
    base.update(config.model)
    model = from_mapping(LingConfig, base, where="model settings")
    model.validate()
    if vocab_size > model.vocab_size:
        raise UsageError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {model.vocab_size}")
    return model


def check_preset_shape(name: str, init: LingConfig, source: str) -> None:
    """An explicitly chosen preset must have the shape of the checkpoint a run starts from."""
    shape = dataclasses.asdict(preset(name))
    have = dataclasses.asdict(init)
    for field_name in SHAPE_FIELDS:
        if field_name == "vocab_size" and name in ("tiny", "small"):
            continue  # these presets take their vocabulary from the tokenizer: the checkpoint's here
        if shape[field_name] != have[field_name]:
            raise UsageError(
                f"--preset {name} has {field_name}={shape[field_name]!r} but {source} has {have[field_name]!r}",
                hint="drop --preset (the checkpoint sets the shape) or start from a checkpoint of that shape",
            )


def check_model_changes(changes: Mapping[str, Any], init: LingConfig, source: str) -> None:
    """Model settings of a run started from a checkpoint: known fields, and none that changes its shape."""
    base = dataclasses.asdict(init)
    unknown = sorted(set(changes) - set(base))
    if unknown:
        raise UsageError(f"unknown model field {unknown[0]!r}", hint="use config.json names, e.g. model.rope_theta=1e6")
    for name, value in changes.items():
        if name in SHAPE_FIELDS and value != base[name]:
            raise UsageError(
                f"model.{name}={value!r} does not match {source}, which has {base[name]!r}",
                hint="a run started from a checkpoint keeps its shape",
            )


def _init_model_config(config: TrainConfig, init: LingConfig, *, vocab_size: int, seq_len: int) -> LingConfig:
    base = dataclasses.asdict(init)
    source = f"the checkpoint ({config.init_from})"
    check_model_changes(config.model, init, source)
    base.update(config.model)
    base["max_position_embeddings"] = max(base["max_position_embeddings"], seq_len)
    model = from_mapping(LingConfig, base, where="model settings")
    model.validate()
    if vocab_size > model.vocab_size:
        raise UsageError(f"the tokenizer has {vocab_size} tokens but {source} has vocab_size {model.vocab_size}")
    return model
