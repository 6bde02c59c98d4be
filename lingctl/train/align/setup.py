"""A set-up of ``lingctl train align`` (``key=value,...``) and the job both sides share: model, weights, batch,
loss and the modules traced."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from lingctl.core.errors import UsageError
from lingctl.model.config import LingConfig
from lingctl.model.moe import Dispatch, grouped_mm_available
from lingctl.runs.train_config import MoeLossConfig
from lingctl.train.align.router import BUGS

Dtype = Literal["float32", "bfloat16", "float64"]
Device = Literal["cpu", "cuda"]
Mode = Literal["ddp", "edit"]
Balance = Literal["rank", "batch"]


@dataclass(kw_only=True, slots=True)
class SetUp:
    """One side of an alignment, written ``key=value,key=value`` (``parse_setup``)."""

    # float32; bfloat16 = autocast with float32 master weights, as ``lingctl train --dtype bfloat16``;
    # float64 = the model in float64 (routers, the expert combine and NormHead still compute in float32).
    dtype: Dtype = "float32"
    dispatch: Dispatch = "sorted"
    device: Device = "cpu"
    workers: int = 1  # >1: that many gloo processes on this machine, the batch split between them
    mode: Mode = "ddp"  # with workers: DDP's averaged gradients, or EDiT's mean of one local step's gradients
    # With workers, the balance loss's routed fractions f_i: each worker's own (``rank``, what training
    # computes) or the whole batch's (``batch``: the expert counts are all-reduced), which makes the loss equal
    # to one worker's on the whole batch, so a comparison with workers=1 tests only the synchronisation.
    balance: Balance = "rank"
    checkpoint: str | None = None  # weights to load (default: the job's --model, else the seeded init)
    bug: str | None = None  # KIND@MODULE, a planted bug (BUGS)

    def describe(self) -> str:
        """The spec back, keys that do not apply (one worker's mode, unset weights or bug) left out."""
        keys = ["dtype", "dispatch", "device"] + (["workers", "mode", "balance"] if self.workers > 1 else [])
        keys += [k for k in ("checkpoint", "bug") if getattr(self, k) is not None]
        return ",".join(f"{k}={getattr(self, k)}" for k in keys)

    def bug_parts(self) -> tuple[str, str] | None:
        if self.bug is None:
            return None
        kind, _, module = self.bug.partition("@")
        return kind, module


SPEC_KEYS = tuple(f.name for f in dataclasses.fields(SetUp))
# The keys with a fixed set of values, read off the dataclass's Literal types.
_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": get_args(Dtype),
    "dispatch": get_args(Dispatch),
    "device": get_args(Device),
    "mode": get_args(Mode),
    "balance": get_args(Balance),
}


def parse_setup(text: str, *, side: str = "a") -> SetUp:
    """``dtype=bfloat16,dispatch=grouped`` → SetUp; an unknown key or a bad value is a UsageError naming it."""
    values: dict[str, Any] = {}
    choices = _CHOICES
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if key not in SPEC_KEYS:
            raise UsageError(f"--{side}: unknown key {key!r} in {text!r}", hint=f"keys: {', '.join(SPEC_KEYS)}")
        if not eq or not value:
            raise UsageError(f"--{side}: {key} needs a value ({key}=VALUE)")
        if key in choices and value not in choices[key]:
            raise UsageError(f"--{side}: {key}={value!r} is not one of {', '.join(choices[key])}")
        if key == "workers":
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--{side}: workers={value!r} must be a whole number >= 1")
            values[key] = int(value)
        elif key == "bug":
            kind, at, module = value.partition("@")
            if kind not in BUGS or not at or not module:
                raise UsageError(
                    f"--{side}: bug={value!r}: write KIND@MODULE with KIND one of {', '.join(BUGS)}",
                    hint="e.g. bug=router-no-renorm@model.layers.1.mlp.gate",
                )
            values[key] = value
        else:
            values[key] = value
    setup = SetUp(**values)
    check_setup(setup, side=side)
    return setup


def check_setup(setup: SetUp, *, side: str) -> None:
    """What this machine and torch cannot run, refused before anything is built."""
    if setup.dispatch == "grouped" and not grouped_mm_available():
        raise UsageError(f"--{side}: dispatch=grouped needs torch._grouped_mm, which this torch lacks")
    if setup.dispatch == "grouped" and setup.dtype == "float64":
        raise UsageError(f"--{side}: dispatch=grouped has no float64 kernel (torch._grouped_mm); use naive or sorted")
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--{side}: device=cuda, but torch sees no CUDA device on this machine")
    if setup.device == "cuda" and setup.workers > 1:
        raise UsageError(f"--{side}: workers > 1 run on the CPU (gloo) only; drop device=cuda or workers")


@dataclass(kw_only=True, slots=True)
class AlignJob:
    """What both sides share: the model, the weights, the batch, the loss and which modules are traced."""

    config: LingConfig
    checkpoint: str | None = None  # --model DIR; None: the preset's init, seeded by ``seed``
    seed: int = 0
    batch_size: int = 4
    seq_len: int = 32
    modules: str | None = None  # regex on module names; None traces every module
    loss: MoeLossConfig = field(default_factory=MoeLossConfig)

    def validate(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise UsageError(f"--batch-size and --seq-len must be >= 1, got {self.batch_size} and {self.seq_len}")
        if self.modules is not None:
            try:
                re.compile(self.modules)
            except re.error as exc:
                raise UsageError(f"--modules {self.modules!r}: not a regular expression ({exc})") from None


def make_batch(job: AlignJob, vocab_size: int) -> torch.Tensor:
    """[B, S + 1] token ids from the seed: inputs are [:, :-1], targets [:, 1:] (as training's batches)."""
    g = torch.Generator().manual_seed(job.seed)
    return torch.randint(0, vocab_size, (job.batch_size, job.seq_len + 1), generator=g)


def check_recorded_setup(data: Any) -> str | None:
    """Why ``data``, a set-up as a trace file records it (``dataclasses.asdict``), is not one ``parse_setup``
    could have made; None when it is. The report reads every field, so each must have its type and values."""
    if not isinstance(data, dict):
        return "expected an object"
    unknown = sorted(str(k) for k in data if k not in SPEC_KEYS)
    if unknown:
        return f"unknown key {unknown[0]!r}"
    for key, allowed in _CHOICES.items():
        if data.get(key) not in allowed:
            return f"{key} is not one of {', '.join(allowed)}"
    workers = data.get("workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        return "workers is not a whole number >= 1"
    for key in ("checkpoint", "bug"):
        value = data.get(key)
        if value is not None and (not isinstance(value, str) or not value.isprintable()):
            return f"{key} is not text"
    return None
