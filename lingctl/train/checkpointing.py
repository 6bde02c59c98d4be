"""The run's checkpoints, written and read back: what the trainer calls to save, and to load on a resume or a
rollback (as torchtitan's trainer calls its checkpoint manager).

A checkpoint directory ``checkpoints/step-NNNNNNNN/`` holds the Hugging Face files flood loads (weights,
config.json last), ``train_config.json``, and ``state/``: the model, the optimizer and this worker's place in
the run, as one pcache checkpoint (planned across ranks, streamed through a bounded buffer, committed by its
marker). It becomes the run's latest only once it is whole (``RunDir.publish_checkpoint``).

Keys: DCP writes one copy of a key every rank holds, so what differs between workers (a worker's position, and
with local SGD its own optimizer) gets a key of its own. Checkpoints written before ``state/`` existed (a
``train_state.pt`` beside ``model.safetensors``) still load.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lingctl.core.atomic import atomic_write
from lingctl.core.config import to_dict
from lingctl.core.errors import NotFoundError, UsageError, VerificationError
from lingctl.core.names import join_under
from lingctl.model.checkpoint import save_checkpoint
from lingctl.model.checkpoint_files import LEGACY_TRAIN_STATE, STATE_DIR, TRAIN_CONFIG, WEIGHTS
from lingctl.model.ling import LingForCausalLM
from lingctl.model.safetensors_io import load_safetensors
from lingctl.pcache.checkpoint import load as pcache_load
from lingctl.pcache.checkpoint import save as pcache_save
from lingctl.pcache.checkpoint import saved_keys
from lingctl.pcache.marker import read_marker
from lingctl.runs.layout import METRICS, checkpoint_name
from lingctl.runs.records import Record
from lingctl.runs.train_config import TrainConfig
from lingctl.train.rundir import RunDir
from lingctl.train.workers import Workers


class TrainingState(Protocol):
    """What a checkpoint holds of the training loop itself, besides the model and the optimizer."""

    def progress(self) -> dict[str, Any]:
        """The loop's position as JSON: step, data position, spike guard, router statistics ..."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Back to ``progress()`` as saved (with ``rng``: torch's RNG state); KeyError, TypeError or ValueError
        when the saved state is damaged."""
        ...

    def extra_state(self) -> dict[str, Any]:
        """Tensors a training mode adds (local SGD's outer optimizer); a template of the right shapes when
        loading."""
        ...

    def load_extra_state(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True, slots=True)
class ModelFiles:
    """What a checkpoint's Hugging Face files carry besides the weights."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any] | None  # None: lingctl's own
    code_repo: str | None  # the Hub repository config.json's auto_map names


@dataclass(kw_only=True, slots=True)
class CheckpointManager:
    run: RunDir
    workers: Workers
    config: TrainConfig
    model: LingForCausalLM
    optimizer: torch.optim.Optimizer
    owner: TrainingState  # the training loop, for its own state

    def save(self, name_step: int, files: ModelFiles, *, flush: Callable[[], None] | None = None) -> Record:
        """Checkpoint ``checkpoints/step-{name_step}`` on every worker together; its metrics record.
        ``flush``: called before metrics.jsonl is published with it."""
        began = time.monotonic()
        rel = checkpoint_name(name_step)
        directory = self.run.local / rel
        w = self.workers
        if w.local_rank == 0:  # listed as lingctl's before any worker writes into it
            self.run.claim_checkpoint(rel, main=w.is_main)
        w.barrier()
        if w.is_main:
            save_checkpoint(
                self.model,
                directory,
                tokenizer_json=files.tokenizer_json,
                tokenizer_config=files.tokenizer_config,
                max_shard_size=self.config.max_shard_size,
                code_repo=files.code_repo,
            )
        progress = self.owner.progress()
        pcache_save(self._state(json.dumps(progress)), directory / STATE_DIR, extra={"step": progress["step"]})
        if w.is_main:
            with atomic_write(directory / TRAIN_CONFIG) as (_, f):
                f.write(json.dumps(to_dict(self.config), indent=2).encode())
            if flush is not None:
                flush()
            names = sorted(p.relative_to(self.run.local).as_posix() for p in directory.iterdir() if p.is_file())
            # Weights first, config.json last: a half-uploaded checkpoint has no config.
            names.sort(key=lambda name: name.endswith("/config.json"))
            self.run.publish_checkpoint(name_step, rel, names + [METRICS])
            self.run.prune(self.config.keep_checkpoints, rel)
        w.barrier()
        # save_s: the launcher's hang timeout must outlast the longest save (no collective runs during one).
        return {
            "event": "checkpoint",
            "step": name_step,
            "tokens": progress["tokens"],
            "path": f"{self.run.describe()}/{rel}",
            "save_s": round(time.monotonic() - began, 3),
        }

    def load(self, latest: dict[str, Any]) -> None:
        """The checkpoint ``latest`` (latest.json's record) into the model, the optimizer and the owner."""
        ckpt = join_under(self.run.local, latest["path"], what="latest.json path")
        if (ckpt / STATE_DIR).is_dir():
            state = self._load_state(ckpt / STATE_DIR)
        else:
            state = self._load_legacy(ckpt)
        try:
            self.owner.restore(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise VerificationError(
                f"{ckpt}: the saved training state is damaged ({type(exc).__name__}: {exc})",
                hint="resume from another checkpoint, or start a new run",
            ) from None

    def keys(self) -> tuple[str, str]:
        """The state-dict keys of this worker's position and of its optimizer."""
        w = self.workers
        own = "" if w.world == 1 else f".rank{w.rank}"
        return "train" + own, "optimizer" + (own if self.config.sync != "ddp" else "")

    def _state(self, progress: str) -> dict[str, Any]:
        train_key, optim_key = self.keys()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            optim_key: optim_sd,
            train_key: {"meta": progress, "rng": torch.get_rng_state()},
            **self.owner.extra_state(),
        }

    def _load_state(self, directory: Path) -> dict[str, Any]:
        """Model and optimizer from the run's pcache checkpoint; returns the rest of the training state."""
        self._check_marker(directory)
        train_key, optim_key = self.keys()
        template = self._state("")
        # Only the optimizer state the checkpoint has: a parameter that had no gradient before the save (an
        # expert no token reached) has none there, and keeps none, as in the run that saved it.
        saved = saved_keys(directory)
        states: dict[str, Any] = template[optim_key]["state"]
        template[optim_key]["state"] = {
            fqn: st for fqn, st in states.items() if f"{optim_key}.state.{fqn}.step" in saved
        }
        pcache_load(template, directory)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=template["model"],
            optim_state_dict=template[optim_key],
            options=StateDictOptions(strict=False),
        )
        self.owner.load_extra_state(template)
        state: dict[str, Any] = json.loads(template[train_key]["meta"])
        state["rng"] = template[train_key]["rng"]
        return state

    def _check_marker(self, directory: Path) -> None:
        """The checkpoint was committed, by as many workers as this job has."""
        marker = read_marker(directory)  # one line and exit 4 when it is not a pcache marker
        if marker is None:
            raise NotFoundError(
                f"{directory}: the checkpoint has no commit marker (its save did not finish)",
                hint="resume from a complete checkpoint",
            )
        saved = marker.get("world_size", 1)
        if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
            raise VerificationError(
                f"{directory}: the commit marker's world_size {saved!r} is not a worker count",
                hint="the checkpoint is damaged; resume from another one",
            )
        if saved != self.workers.world:
            raise UsageError(
                f"the run was checkpointed by {saved} worker(s); this job has {self.workers.world}",
                hint=f"resume with --nproc {saved}",
            )

    def _load_legacy(self, ckpt: Path) -> dict[str, Any]:
        """A checkpoint from before ``state/``: model.safetensors and train_state.pt."""
        weights = load_safetensors(ckpt / WEIGHTS)
        if self.model.config.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.word_embeddings.weight"]
        self.model.load_state_dict(weights, strict=True)
        state: dict[str, Any] = torch.load(ckpt / LEGACY_TRAIN_STATE, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        return state
