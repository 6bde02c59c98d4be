"""Training curves for TensorBoard or Weights & Biases, from the same records that go to metrics.jsonl.

A reporter sees only the records (``event``: step, eval, ...), never the trainer, so what it shows is what
the run's metrics file holds. Both backends log the same scalar names (:func:`scalars`):

    train/loss  train/lr  train/grad_norm  train/tokens_per_s  train/spikes_skipped (cumulative)
    eval/loss
    experts/layer_{i}/cv             coefficient of variation of the per-expert token counts of MoE layer i
    experts/layer_{i}/max_over_mean  the busiest expert's tokens over the mean (1.0 = perfectly even)
    workers/rank_{r}/tokens_per_s    several workers: each one's tokens over its own busy time (synchronous
                                     steps: its previous step, waits for the others excluded; local SGD: the
                                     period before each sync)
    rewards/chosen  rewards/rejected  rewards/margins  rewards/accuracies
                                     train dpo: the implicit rewards beta * (log pi - log ref) of the
                                     chosen and rejected answers, their mean difference, and how often the
                                     chosen one's is higher (TRL's names)
    train/preference_loss  train/chosen_nll

Each backend's package is imported only when asked for: :func:`require` fails with one line naming the
extra to install, before the run starts.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"  # inside the run's local directory (the staging copy for s3:// runs)

_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}  # kind: (module, extra)

Record = dict[str, Any]


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars a record contributes, by tag (empty for events that have none)."""
    event = record.get("event")
    if event == "eval":
        return {"eval/loss": float(record["eval_loss"])}
    workers = {
        f"workers/rank_{r}/tokens_per_s": float(v) for r, v in enumerate(record.get("worker_tokens_per_s") or [])
    }
    if event == "sync":
        return workers
    if event != "step":
        return {}
    out = {
        **workers,
        "train/loss": float(record["loss"]),
        "train/lr": float(record["lr"]),
        "train/grad_norm": float(record["grad_norm"]),
        "train/tokens_per_s": float(record["tokens_per_s"]),
        "train/spikes_skipped": float(record.get("spikes_skipped", 0)),
    }
    # The step record's expert_load holds, per MoE layer, max/mean and min/mean of the per-expert token
    # counts and their cv (losses.expert_load), so max_over_mean is its "max".
    # A DPO step's figures, under the names TRL's DPOTrainer logs them with.
    for name, value in (record.get("task") or {}).items():
        out[_TASK_NAMES.get(name, f"train/{name}")] = float(value)
    for i, layer in enumerate(record.get("expert_load") or []):
        out[f"experts/layer_{i}/cv"] = float(layer["cv"])
        out[f"experts/layer_{i}/max_over_mean"] = float(layer["max"])
    return out


_TASK_NAMES = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "reward_accuracy": "rewards/accuracies",
}


def require(kind: str) -> None:
    """Fail now, with one line, when the package ``kind`` reports through is not installed."""
    if kind == "none":
        return
    module, extra = _PACKAGES[kind]
    try:
        importlib.import_module("torch.utils.tensorboard" if kind == "tensorboard" else module)
    except ImportError:
        raise LingctlError(f"--report-to {kind} needs the {module} package: pip install 'lingctl[{extra}]'") from None


def event_dir(local_run_dir: Path) -> Path:
    return Path(local_run_dir) / TENSORBOARD_DIR


class Reporter:
    """Takes records; writes what :func:`scalars` makes of them. Opened on the first record with scalars,
    so nothing is created in a run directory that is refused before it starts."""

    kind = ""
    directory: Path | None = None  # where its files go, when that is for lingctl to say

    def record(self, record: Mapping[str, Any]) -> None:
        values = scalars(record)
        if values:
            self._log(values, int(record["step"]))

    def _log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardReporter(Reporter):
    kind = "tensorboard"

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._writer: Any = None

    def _log(self, values: dict[str, float], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run repeats the steps after its checkpoint: purge_step hides the earlier files'
            # events from this step on, so the curves show each step once.
            self._writer = SummaryWriter(str(self.directory), purge_step=step)
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbReporter(Reporter):
    """One W&B run per lingctl run session; wandb itself reads WANDB_MODE (offline), WANDB_PROJECT, etc."""

    kind = "wandb"

    def __init__(self, run_dir: Path, *, name: str, config: Mapping[str, Any]) -> None:
        self.run_dir = Path(run_dir)  # wandb keeps its files in run_dir/wandb/ and says where itself
        self.name = name
        self.config = dict(config)
        self._run: Any = None

    def _log(self, values: dict[str, float], step: int) -> None:
        if self._run is None:
            import wandb

            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "lingctl",
                name=self.name,
                dir=str(self.run_dir),
                config=self.config,
            )
        self._run.log(values, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def report_dir_name(kind: str) -> str:
    """The directory a reporter of ``kind`` writes in the run directory."""
    return TENSORBOARD_DIR if kind == "tensorboard" else kind  # wandb keeps its files in wandb/


def open_reporter(kind: str, local_run_dir: Path, *, name: str, config: Mapping[str, Any]) -> Reporter | None:
    """The reporter for ``kind`` (``none``: None). Call :func:`require` first for a one-line error."""
    if kind == "tensorboard":
        return TensorBoardReporter(event_dir(local_run_dir))
    if kind == "wandb":
        return WandbReporter(local_run_dir, name=name, config=config)
    return None
