"""``lingctl train`` settings: one typed config, from a preset's defaults, a TOML file and flags.

The whole config is saved with every checkpoint (``train_config.json``), so a run can be resumed or inspected
from its directory alone. Each field is declared once, with its range rule, its flag and help text and its
resume rules (``lingctl.runs.settings``); ``lingctl train``'s options are derived from it. Nothing here loads
torch: the command line is built from these classes at start-up.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.units import parse_size
from lingctl.model.presets import PRESETS, preset
from lingctl.runs.settings import Check, check_settings, number, one_of, setting, whole

# The default of lingctl.model.hf_files.DEFAULT_MAX_SHARD_SIZE, which loads torch; a test holds the two equal.
MAX_SHARD_SIZE = "5GB"
# "": lingctl's own modeling code beside the weights (self-contained checkpoints); ORG/NAME: a Hub repository's.
CODE_REPO = ""

REPORT_TO = ("none", "tensorboard", "wandb")


def _is_size(value: Any) -> bool:
    try:
        parse_size(value)
    except UsageError:
        return False
    return True


def _attempts(value: Any) -> bool:
    return all(not isinstance(a, bool) and isinstance(a, int) and a >= 0 for a in value)


_SIZE: Check = (_is_size, "a size such as 5GB or 500MiB")
_ATTEMPTS: Check = (_attempts, "a list of attempt numbers >= 0")
_SWITCH: Check = (lambda v: isinstance(v, bool), "true or false")


def parse_saved(raw: bytes, where: str) -> dict[str, Any]:
    """A checkpoint's ``train_config.json`` (read from ``where``) as the table a TrainConfig is built from;
    ``VerificationError`` (exit 4) when it is not a JSON object."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise VerificationError(
            f"{where} is damaged: not a JSON object",
            hint="resume needs the settings the run was started with; restore the file",
        )
    return data


def parse_pair(text: str | None, what: str) -> tuple[int, int] | None:
    """ "A:B" of two whole numbers >= 0 (the drills' RANK:STEP and STEP:COUNT)."""
    if text is None:
        return None
    parts = str(text).split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"{what} must be two whole numbers A:B, got {text!r}")
    return int(parts[0]), int(parts[1])


@dataclass(kw_only=True, slots=True)
class DataConfig:
    # Text files, directories, globs or JSONL files; empty = the Python standard library's sources.
    paths: list[str] = setting(
        default_factory=list,
        flag="--data",
        short="-d",
        metavar="PATH",
        help="Text files, directories, globs or JSONL ('text' field); repeatable. "
        "Default: the Python standard library's sources.",
    )
    # An existing tokenizer.json; None = train a byte-level BPE on the corpus (saved in the run directory).
    tokenizer: str | None = setting(
        None,
        flag="--tokenizer",
        metavar="FILE|DIR|ORG/NAME[@REV]",
        help="An existing tokenizer: a tokenizer.json, a directory holding one, or a Hub id from the local "
        "Hugging Face cache (default: the --init-from checkpoint's, else a byte-level BPE trained on the data).",
    )
    vocab_size: int | None = setting(None, rule=whole(1))  # None = the preset's
    text_field: str = "text"  # JSONL field holding the document
    eval_fraction: float = setting(0.02, rule=number(0, 1, below=True))
    # Caps how much text is read; the default corpus is capped so that setup takes seconds.
    max_bytes: int | None = setting(None, rule=whole(1))

    def validate(self) -> None:
        check_settings(self, "data.")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float | None = setting(
        None, rule=number(0, above=True), flag="--lr", help="Peak learning rate [default: the preset's]."
    )
    min_lr_ratio: float = setting(0.1, rule=number(0, 1))
    warmup_steps: int = setting(20, rule=whole(0))
    weight_decay: float = setting(0.1, rule=number(0))
    beta1: float = setting(0.9, rule=number(0, 1, below=True))
    beta2: float = setting(0.95, rule=number(0, 1, below=True))
    eps: float = setting(1e-8, rule=number(0, above=True))
    grad_clip: float = setting(1.0, rule=number(0))  # 0 = no clipping

    def validate(self) -> None:
        check_settings(self, "optim.")


@dataclass(kw_only=True, slots=True)
class MoeLossConfig:
    balance_coef: float = setting(0.01, rule=number(0))  # alpha of the load-balance loss
    z_coef: float = setting(0.001, rule=number(0))  # router z-loss coefficient
    routing_warmup_steps: int = setting(20, rule=whole(0))  # stochastic routing warmup length (0 = off)

    def validate(self) -> None:
        check_settings(self, "moe.")


LOSS_ON = ("assistant", "all", "last")
TASKS = ("pretrain", "sft", "dpo")


@dataclass(frozen=True, slots=True)
class Stage:
    """A stage of the length curriculum: rows of ``seq_len`` tokens."""

    seq_len: int
    long_fraction: float | None  # the share of the stage's examples that are its own (longer) ones; None: all


def parse_schedule(text: str | None, seq_len: int) -> list[Stage]:
    """``--seq-len-schedule "4096,16384@0.05"`` as stages; none: one stage of ``seq_len``."""
    if not text:
        return [Stage(seq_len, None)]
    stages: list[Stage] = []
    for i, part in enumerate(text.split(",")):
        length, sep, fraction = part.strip().partition("@")
        try:
            n, f = int(length), (float(fraction) if sep else None)
        except ValueError:
            raise UsageError(f"--seq-len-schedule: {part!r} is not LENGTH or LENGTH@FRACTION") from None
        if n < 2 or (stages and n <= stages[-1].seq_len):
            raise UsageError(f"--seq-len-schedule: lengths must grow and be at least 2, got {text!r}")
        if i == 0 and f is not None:
            raise UsageError("--seq-len-schedule: the first stage takes no fraction (it holds all the short examples)")
        if i > 0 and (f is None or not 0 < f <= 1):
            raise UsageError(f"--seq-len-schedule: stage {i + 1} needs a fraction in (0, 1], e.g. {n}@0.05")
        stages.append(Stage(n, f))
    return stages


@dataclass(kw_only=True, slots=True)
class PostConfig:
    """Fine-tuning (``lingctl train sft`` and ``train dpo``); the subcommands set these from their options."""

    # Which tokens an SFT example trains on: assistant turns, every token, or the last assistant turn only.
    loss_on: str = setting("assistant", rule=one_of(*LOSS_ON))
    beta: float = setting(0.1, rule=number(0, above=True))  # DPO: strength of the pull towards the reference
    nll_weight: float = setting(0.0, rule=number(0))  # DPO: weight of the chosen answers' NLL (TRL's rpo_alpha)
    # Length curriculum, e.g. "4096,16384@0.05"; None = one stage of seq_len.
    seq_len_schedule: str | None = None

    def validate(self) -> None:
        check_settings(self, "post.")
        parse_schedule(self.seq_len_schedule, 2)


@dataclass(kw_only=True, slots=True)
class SpikeConfig:
    """The loss-spike guard (``lingctl.train.spike``)."""

    enabled: bool = True
    # Steps of normal training before the guard may flag anything (the averages need data first).
    warmup_steps: int = setting(20, rule=whole(0))
    ema_beta: float = setting(0.95, rule=number(0, 1, above=True, below=True))
    loss_z: float = setting(6.0, rule=number(0, above=True))
    loss_ratio: float = setting(1.3, rule=number(0, above=True))  # loss must also exceed ratio * EMA
    grad_z: float = setting(6.0, rule=number(0, above=True))
    grad_ratio: float = setting(4.0, rule=number(0, above=True))
    # A skipped batch is retried this many optimizer steps later; a batch that spikes again is dropped.
    retry_after_steps: int = setting(20, rule=whole(0))
    max_retries: int = setting(1, rule=whole(0))
    # `max_spikes` spikes within `window_steps` steps lower the LR by `lr_factor` (down to `min_lr_scale`).
    window_steps: int = setting(100, rule=whole(1))
    max_spikes: int = setting(3, rule=whole(1))
    lr_factor: float = setting(0.5, rule=number(0, 1, above=True))
    min_lr_scale: float = setting(0.01, rule=number(0, 1, above=True))

    def validate(self) -> None:
        # ValueError: the guard is a library object too; TrainConfig turns it into a usage error.
        check_settings(self, "spike.", error=ValueError)


@dataclass(kw_only=True, slots=True)
class EditConfig:
    """EDiT local SGD's synchronisation (``lingctl.train.edit``)."""

    outer_lr: float = setting(0.7, rule=number(0, above=True))
    outer_momentum: float = setting(0.8, rule=number(0, 1, below=True))  # Nesterov
    # EMA rate of each worker's pseudo-gradient norm statistics.
    anomaly_alpha: float = setting(0.02, rule=number(0, 1, above=True))
    # z-score above which a worker's delta is dropped.
    anomaly_threshold: float = setting(3.0, rule=number(0, above=True, finite=False))
    # Syncs before the z-test applies (statistics still update); a z-score needs one accepted norm at least.
    anomaly_warmup: int = setting(3, rule=whole(1))
    # weights = softmax(-||delta_i|| / T) over the kept workers
    weight_temperature: float = setting(1.0, rule=number(0, above=True))
    # Max norm of the averaged delta, per unit (None: no clipping).
    clip_norm: float | None = setting(1.0, rule=number(0, above=True))
    layerwise: bool = True  # sync during the forward of the sync step, with prefetch

    def validate(self) -> None:
        # ValueError: EditSynchronizer is a library object too; TrainConfig turns it into a usage error.
        check_settings(self, "edit.", error=ValueError)


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    """When a run is unhealthy, and what a rollback does: what the workers call divergence (Ling report §3:
    retry or skip wide spikes, lower the learning rate when they persist), and when routing or a worker's
    pace is worth a warning. Its settings are ``watchdog_config.*``, after the ``watchdog`` setting."""

    # This many skipped spikes within `window_steps` steps are a divergence, not noise (the spike guard's
    # own LR drop comes first, at spike.max_spikes).
    spikes: int = setting(6, rule=whole(1))
    window_steps: int = setting(100, rule=whole(1))
    lr_factor: float = setting(0.5, rule=number(0, 1, above=True, below=True))  # per rollback, on the LR
    max_rollbacks: int = setting(3, rule=whole(0))  # then the run ends with exit 1 (a give_up incident)
    # Routing health, warned about (no action) when a MoE layer passes either threshold over the last
    # `routing_window` steps on average, or has an expert that got no token in all of them (dead expert).
    routing_cv: float = setting(1.5, rule=number(0, above=True))
    routing_max_over_mean: float = setting(4.0, rule=number(0, above=True))
    routing_window: int = setting(20, rule=whole(1))
    # A synchronous worker whose busy time per step is this many times the others' median, on average over
    # `straggler_window` steps, is reported as a straggler (warning).
    straggler_ratio: float = setting(1.5, rule=number(0, above=True))
    straggler_window: int = setting(20, rule=whole(1))

    def validate(self) -> None:
        check_settings(self, "watchdog_config.")


def _drill(default: Any = None, *, help: str | None = None, **meta: Any) -> Any:
    """A fault drill's setting (off by default): a resume may change it; its help says it is a drill."""
    if "default_factory" in meta:
        default = dataclasses.MISSING
    return setting(default, help=f"Fault drill: {help}" if help else None, resumable=True, **meta)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    preset: str = setting(
        "small", flag="--preset", short="-p", metavar="|".join(PRESETS), help=f"Model shape: {', '.join(PRESETS)}."
    )
    # Changes to the preset's model shape, with config.json names: {num_hidden_layers = 2}.
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = setting(200, rule=whole(1), flag="--steps", help="Optimizer steps in total.", resumable=True)
    max_seconds: float | None = setting(
        None,
        rule=number(0, above=True),
        flag="--max-seconds",
        metavar="DURATION",
        duration=True,
        help="Stop (with a checkpoint) after this much wall time ({duration}).",
        resumable=True,
    )
    # Per worker and step; the caps are far above any real run and keep a typo from allocating terabytes.
    batch_size: int | None = setting(
        None, rule=whole(1, 2**20), flag="--batch-size", help="Sequences per step [default: the preset's]."
    )  # None = the preset's
    batch_warmup_steps: int = setting(0, rule=whole(0))
    batch_start: int = setting(1, rule=whole(1))
    seq_len: int | None = setting(
        None, rule=whole(2, 2**20), flag="--seq-len", help="Tokens per sequence [default: the preset's]."
    )  # None = the preset's
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Routing-warmup noise seeds are derived as (seed * 1e6 + attempt) * 1e3: 32 bits keep that in 64.
    seed: int = setting(
        0, rule=whole(0, 2**32 - 1), flag="--seed", help="Seeds initialisation, data order and routing-warmup noise."
    )
    # Start from this Ling checkpoint (a directory or a Hub id, ORG/NAME[@REV]): its shape, weights and
    # tokenizer; the preset then only supplies training defaults (sequence length, batch size, learning rate).
    init_from: str | None = setting(
        None,
        flag="--init-from",
        metavar="DIR|ORG/NAME[@REV]",
        help="Start from this Ling (bailing_moe) checkpoint: lingctl's or the Hub layout, sharded or not, a "
        "directory or a Hub id (Hugging Face cache; downloaded when missing unless HF_HUB_OFFLINE=1). Its "
        "shape, weights and tokenizer are used; --preset then only sets training defaults.",
    )
    # Checkpoint files as Hugging Face writes them: weights split into shards of at most this size, and the
    # Hub repository whose Ling code config.json's auto_map names ("" = code files beside the weights).
    max_shard_size: str = setting(
        MAX_SHARD_SIZE,
        rule=_SIZE,
        flag="--max-shard-size",
        metavar="SIZE",
        help="Checkpoint weights go into safetensors shards of at most this size, with an index (default 5GB, "
        "as save_pretrained).",
        resumable=True,
    )
    hf_code_repo: str = setting(
        CODE_REPO,
        flag="--hf-code-repo",
        metavar="ORG/NAME",
        help="A Hub repository whose modeling code config.json's auto_map names for transformers' "
        "trust_remote_code, e.g. inclusionAI/Ling-lite (default: lingctl's own code, written beside the weights, "
        "so checkpoints load offline).",
        resumable=True,
    )
    # bfloat16 = autocast; master weights stay float32
    dtype: Literal["float32", "bfloat16"] = setting("float32", flag="--dtype", help="float32, or bfloat16 autocast.")
    dispatch: Literal["naive", "sorted", "grouped"] = setting(
        "sorted", flag="--dispatch", help="MoE dispatch: naive, sorted, grouped."
    )
    eval_every: int = setting(
        50, rule=whole(0), flag="--eval-every", help="Steps between evals (0: only at the end).", resumable=True
    )
    eval_batches: int = setting(4, rule=whole(1), resumable=True)
    save_every: int = setting(
        50, rule=whole(0), flag="--save-every", help="Steps between checkpoints (0: only at the end).", resumable=True
    )
    keep_checkpoints: int = setting(2, rule=whole(1), resumable=True)
    # Where metrics go besides metrics.jsonl: TensorBoard event files in the run's tensorboard/ directory,
    # or Weights & Biases (the wandb package; it reads WANDB_MODE, WANDB_PROJECT and the like itself).
    report_to: Literal["none", "tensorboard", "wandb"] = setting(
        "none",
        rule=one_of(*REPORT_TO),
        flag="--report-to",
        help="Also send the curves to TensorBoard (event files in RUN/tensorboard) or Weights & Biases (default none).",
        resumable=True,
    )
    # This many skipped attempts in a row (spikes, non-finite loss or gradients) end the run with exit 1:
    # a diverged run would otherwise skip for ever. Enough for the spike guard's LR drops to take effect.
    max_consecutive_skips: int = setting(
        20,
        rule=whole(1),
        flag="--max-consecutive-skips",
        help="End the run (exit 1) after this many skipped steps in a row: it has diverged (default 20).",
        resumable=True,
    )
    # Learning rate, batch size and steps from a sweep's fitted laws (`lingctl train fit`), for a compute budget.
    auto_hparams: str | None = setting(
        None,
        flag="--auto-hparams",
        metavar="FIT.json",
        help="Take --lr, --batch-size and --steps from a sweep's fit.json (lingctl train fit) for --budget; prints "
        "what it picked and why.",
    )
    budget: float | None = setting(
        None,
        rule=number(0, above=True),
        flag="--budget",
        metavar="FLOPS",
        help="With --auto-hparams: the compute budget, 6 x active parameters x tokens (without it, --steps sets it).",
    )
    force_extrapolation: bool = setting(
        False,
        rule=_SWITCH,
        flag="--force-extrapolation/--no-force-extrapolation",
        help="With --auto-hparams: use the laws even more than 10x beyond the budgets they were fitted on.",
    )
    moe: MoeLossConfig = field(default_factory=MoeLossConfig)
    # What the run trains: pre-training on text, or fine-tuning (the `train sft` and `train dpo` subcommands).
    task: str = setting("pretrain", rule=one_of(*TASKS))
    post: PostConfig = field(default_factory=PostConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    # The watchdog: None = on with several workers. In the workers it rolls a diverged run back to its last
    # checkpoint with a lower learning rate, skipping the data that diverged; in the launcher it detects
    # hung jobs and restarts hung and crashed ones (see docs/train.md).
    watchdog: bool | None = setting(
        None,
        rule=_SWITCH,
        flag="--watchdog/--no-watchdog",
        help="With --nproc: watch the workers' trace rings and restart a job that hangs "
        "[default: on with --nproc > 1].",
        resumable=True,
    )
    watchdog_config: HealthConfig = setting(default_factory=HealthConfig, resumable=True)
    # Several workers (--nproc N, or torchrun): "ddp" = synchronous data parallel (DistributedDataParallel);
    # "edit" = EDiT local SGD: local AdamW steps, a penalised pseudo-gradient average every sync.
    sync: Literal["ddp", "edit"] = setting(
        "ddp",
        rule=(lambda v: v in ("ddp", "edit"), "ddp or edit"),
        flag="--sync",
        help="With several workers: ddp (synchronous) or edit (EDiT local SGD).",
    )
    sync_every: int = setting(10, rule=whole(1), flag="--sync-every", help="edit: local steps between syncs.")
    # edit: sync by time instead; faster workers take more steps
    sync_every_seconds: float | None = setting(
        None,
        rule=number(0, above=True),
        flag="--sync-every-seconds",
        metavar="DURATION",
        duration=True,
        help="edit: sync by time instead ({duration}); faster workers take more local steps.",
    )
    edit_warmup_steps: int = setting(0, rule=whole(0))  # edit: synchronous steps before local SGD starts
    edit: EditConfig = field(default_factory=EditConfig)
    # Fault drills (lingctl.train.drills). At these attempts the loss is multiplied by `inject_spike_factor`.
    inject_spikes: list[int] = _drill(default_factory=list, rule=_ATTEMPTS)
    inject_spike_factor: float = _drill(10.0, rule=number(0, above=True))
    # The process kills itself (SIGKILL) right after this step, before any later checkpoint. With several
    # workers, only worker `crash_rank` does.
    crash_at_step: int | None = _drill(rule=whole(1), once=True)
    crash_rank: int = _drill(0, rule=whole(0))
    # Worker `simulate_slow_rank` runs `slowdown` times slower (it sleeps (slowdown - 1) x its step time after
    # each step); worker `simulate_bad_rank` sends a corrupted update (pseudo-gradient or gradient x100).
    simulate_slow_rank: int | None = _drill(
        rule=whole(0), flag="--simulate-slow-rank", help="this worker runs --slowdown times slower."
    )
    slowdown: float = _drill(1.0, rule=number(1, 1000), flag="--slowdown", help="how much slower.")
    simulate_bad_rank: int | None = _drill(
        rule=whole(0), flag="--simulate-bad-rank", help="this worker's update is corrupted (x100)."
    )
    # In the job's first attempt only (a restart or rollback does not repeat them): rank R blocks for ever in
    # a point-to-point receive at step S ("R:S"); the loss of step S is NaN; N spikes in a row from step S
    # ("S:N"); the router of MoE layer L sends every token to the same experts.
    simulate_hang: str | None = _drill(
        flag="--simulate-hang",
        metavar="R:S",
        help="worker R blocks forever at step S (first attempt only); the watchdog restarts the job.",
        once=True,
    )
    simulate_nan: int | None = _drill(
        rule=whole(1),
        flag="--simulate-nan",
        metavar="S",
        help="a non-finite loss at step S (first attempt only).",
        once=True,
    )
    simulate_spikes: str | None = _drill(
        flag="--simulate-spikes", metavar="S:N", help="N consecutive loss spikes from step S.", once=True
    )
    simulate_routing_collapse: int | None = _drill(
        rule=whole(0),
        flag="--simulate-routing-collapse",
        metavar="LAYER",
        help="the MoE layer LAYER routes every token to the same experts.",
        once=True,
    )

    def validate(self) -> None:
        check_settings(self)
        parse_pair(self.simulate_hang, "simulate_hang (--simulate-hang RANK:STEP)")
        parse_pair(self.simulate_spikes, "simulate_spikes (--simulate-spikes STEP:COUNT)")
        preset(self.preset)  # unknown preset: one line with the choices
        self.post.validate()
