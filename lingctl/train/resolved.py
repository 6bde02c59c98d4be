"""What a run's settings (``lingctl.runs.train_config.TrainConfig``) resolve to: the preset's training defaults
(sequence length, batch size, learning rate, vocabulary) and the model shape, a preset's or the shape of the
checkpoint the run starts from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lingctl.core.config import from_mapping
from lingctl.core.errors import UsageError
from lingctl.model.config import LingConfig
from lingctl.model.presets import preset
from lingctl.runs.train_config import TrainConfig, parse_schedule

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


# Fine-tuning's learning rates when --lr is not given: TRL's defaults (SFTConfig, DPOConfig), which users of
# fine-tuning know; a pre-training rate would undo what the checkpoint learned.
POST_LR = {"sft": 2e-5, "dpo": 1e-6}


def resolve(config: TrainConfig) -> Resolved:
    d = PRESET_TRAINING[config.preset]
    seq_len = config.seq_len or d["seq_len"]
    return Resolved(
        # A length curriculum's longest rows are the ones the model, and the memory plan, must fit.
        seq_len=parse_schedule(config.post.seq_len_schedule, seq_len)[-1].seq_len,
        batch_size=config.batch_size or d["batch_size"],
        lr=config.optim.lr or POST_LR.get(config.task) or d["lr"],
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
