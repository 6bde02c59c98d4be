"""Training on several workers with EDiT local SGD (Ling technical report §2.2).

Each worker takes local AdamW steps on its own data. At a sync the workers' pseudo-gradients (parameters at
the last sync minus now) are combined, with penalties against a noisy worker, and an outer Nesterov SGD
step moves every worker to the same new parameters (``edit.EditSynchronizer``). Normally the sync happens
layer by layer during the forward of the step that follows, each layer's collective prefetched while the
layer before it computes; a sync that ends in a checkpoint, an eval or the end of the run is done whole at
a step boundary, so that what is saved or evaluated is the synced model.

When to sync: every ``sync_every`` local steps, or, with ``sync_every_seconds``, once that much time has
passed since the last sync ended. Workers leave a sync together, so their clocks agree on the period to
within a step; a faster worker simply takes more local steps in it instead of waiting for a straggler.

Budget: ``--steps N`` is N synchronous steps' worth of tokens, N x workers local steps in all. Workers learn
the total at each sync (one small all-gather of counters and flags); the period is shortened as the end
nears so the run stops close to the budget, and stop requests and time limits are honoured at syncs.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from lingctl.runs.records import Record
from lingctl.train.attempt import worker_rates
from lingctl.train.edit import EditSynchronizer
from lingctl.train.trainer import Boundary, Trainer

_STEPS, _STOP, _OUT_OF_TIME, _SYNC_S, _SINCE, _BUSY_S, _TOKENS = range(7)


class LocalSgdTrainer(Trainer):
    def setup(self) -> None:
        self.global_steps = 0  # local steps of all workers together, as of the last sync
        self.syncs = 0
        self.since_sync = 0
        self.warmup_left = self.config.edit_warmup_steps
        super().setup()
        c, w = self.config, self.workers
        if self.resumed_from is not None:  # in synchronous-step equivalents, as checkpoints are named
            self.resumed_from = self.global_steps // w.world
        self.sync = EditSynchronizer(self._units(), c.edit, delta_scale=self.drills.update_scale)
        if self._edit_state is not None:
            self.sync.load_state_dict(self._edit_state)
        else:
            self.sync.reset_anchor()
        self.budget = c.steps * w.world
        self.period_s = c.sync_every_seconds
        self.period_steps = c.sync_every

    def _units(self) -> list[tuple[torch.nn.Module, list[torch.Tensor]]]:
        """Sync units in forward order: embeddings, each layer, then final norm + head (synced when the final
        norm is about to run)."""
        m = self.model
        units: list[tuple[torch.nn.Module, list[torch.Tensor]]] = [
            (m.model.word_embeddings, [m.model.word_embeddings.weight])
        ]
        units += [(layer, list(layer.parameters())) for layer in m.model.layers]
        last: list[torch.Tensor] = [m.model.norm.weight]
        if m.lm_head.weight is not m.model.word_embeddings.weight:
            last.append(m.lm_head.weight)
        units.append((m.model.norm, last))
        return units

    # -- state ----------------------------------------------------------------------------------------
    _edit_state: dict[str, Any] | None = None

    def extra_state(self) -> dict[str, Any]:
        sync = getattr(self, "sync", None)
        if sync is not None:
            return {"edit": sync.state_dict(), "progress": torch.tensor([self.global_steps, self.syncs])}
        # Before the synchronizer exists (loading): a template of the right shape to load into.
        template = EditSynchronizer(self._units(), self.config.edit).state_dict()
        return {"edit": template, "progress": torch.zeros(2, dtype=torch.int64)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self._edit_state = state["edit"]
        self.global_steps, self.syncs = (int(x) for x in state["progress"].tolist())
        self.warmup_left = max(0, self.config.edit_warmup_steps - self.global_steps // self.workers.world)

    # -- synchronous warm-up -------------------------------------------------------------------------
    def _synchronous(self) -> bool:
        return self.warmup_left > 0

    def _after_backward(self) -> None:
        if self.warmup_left > 0:  # plain data-parallel steps: average the gradients
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.workers.world

    # -- progress counted over all workers -----------------------------------------------------------
    def schedule_step(self) -> int:
        return self.global_steps // self.workers.world + self.since_sync

    def checkpoint_step(self) -> int:
        return self.global_steps // self.workers.world

    def _finished(self) -> bool:
        return self.global_steps >= self.budget

    # -- the loop's hooks: a boundary is a sync ------------------------------------------------------
    def _loop_starts(self) -> None:
        self.last_sync_end = time.monotonic()
        self.last_sync_s = 0.0
        self.tokens_since_sync = 0
        self.synced = False
        self.armed: Any = None  # the counters of a layer-wise sync that the next step's forward completes

    def _boundary(self, start: float) -> Boundary:
        """At a due sync: agree on progress (one small all-gather), then sync the model whole when the sync
        ends in an eval, a checkpoint or the end of the run, else arm the layer-wise sync for the next step."""
        c, w = self.config, self.workers
        if self.warmup_left > 0 or not self._sync_due():
            return Boundary()
        counters = w.gather(
            [
                float(self.step),
                1.0 if self.should_stop() else 0.0,
                1.0 if c.max_seconds is not None and time.monotonic() - start >= c.max_seconds else 0.0,
                self.last_sync_s,
                float(self.since_sync),
                time.monotonic() - self.last_sync_end,  # this worker's time since the last sync: its pace
                float(self.tokens_since_sync),
            ]
        )
        before = self.global_steps // w.world
        self.global_steps = int(counters[:, _STEPS].sum())
        progress = self.global_steps // w.world
        stopping, out_of_time = bool(counters[:, _STOP].any()), bool(counters[:, _OUT_OF_TIME].any())
        final = self.global_steps >= self.budget or stopping or out_of_time
        eval_due = bool(c.eval_every) and progress // c.eval_every > before // c.eval_every
        save_due = bool(c.save_every) and progress // c.save_every > before // c.save_every
        self.syncs += 1
        self.synced = True
        if final or eval_due or save_due or not c.edit.layerwise:
            t0 = time.monotonic()
            self.sync.sync_now()
            self.last_sync_s = time.monotonic() - t0
            self._sync_record(counters, "whole")
        else:
            self.sync.arm()
            self.armed = counters
        self._plan_next_period(counters)
        stop = None
        if final:
            stop = (
                "interrupted"
                if stopping
                else "time limit"
                if out_of_time and self.global_steps < self.budget
                else "completed"
            )
        return Boundary(eval=eval_due or final, save=save_due or final, stop=stop)

    def _boundary_done(self) -> None:
        if self.synced:  # the next period starts now, after the sync's eval and checkpoint
            self.synced = False
            self.since_sync = self.tokens_since_sync = 0
            self.last_sync_end = time.monotonic()

    def _step(self) -> Record | None:
        tokens_before = self.tokens
        record = self._attempt()
        if self.armed is not None:  # the forward above completed the layer-wise sync
            self.sync.finish()
            self.last_sync_s = self.sync.last_stats.wait_s
            self._sync_record(self.armed, "layerwise")
            self.armed = None
        if record is None:
            return None
        if self.warmup_left > 0:  # a synchronous step: every worker took it
            self.warmup_left -= 1
            self.global_steps += self.workers.world
            if self.warmup_left == 0:
                self.sync.reset_anchor()  # local SGD starts from the replicas' common parameters
                self.last_sync_end = time.monotonic()
        else:
            self.since_sync += 1
            self.tokens_since_sync += self.tokens - tokens_before
        return record

    def _sync_due(self) -> bool:
        if self.global_steps >= self.budget:  # the warm-up alone used the budget
            return True
        if self.since_sync == 0:
            return False
        if self.period_s is not None:
            return time.monotonic() - self.last_sync_end >= self.period_s
        return self.since_sync >= self.period_steps

    def _plan_next_period(self, counters: Any) -> None:
        """Shorten the next period when the budget would run out inside it."""
        c = self.config
        left = self.budget - self.global_steps
        if left <= 0:
            return
        if c.sync_every_seconds is None:
            self.period_steps = max(1, min(c.sync_every, math.ceil(left / self.workers.world)))
            return
        took = float(counters[:, _SINCE].sum())
        elapsed = max(time.monotonic() - self.last_sync_end, 1e-3)
        rate = took / elapsed if took else 0.0  # local steps per second, all workers together
        self.period_s = c.sync_every_seconds if rate <= 0 else max(1e-3, min(c.sync_every_seconds, left / rate))

    def _sync_record(self, counters: Any, how: str) -> None:
        stats = self.sync.last_stats
        record: Record = {
            "event": "sync",
            "sync": stats.sync,
            "step": self.global_steps // self.workers.world,
            "how": how,
            "local_steps": [int(x) for x in counters[:, _SINCE]],
            "total_local_steps": self.global_steps,
            "previous_sync_s": [round(float(x), 4) for x in counters[:, _SYNC_S]],
            # Each worker's tokens over its own time since the last sync (its wait at this one excluded).
            "worker_tokens_per_s": worker_rates(counters[:, _TOKENS], counters[:, _BUSY_S]),
            **stats.to_record(),
        }
        self._emit(record)
