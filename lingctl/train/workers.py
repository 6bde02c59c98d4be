"""Several training workers, seen from inside one: the process group, who reads which rows, and the few
agreements workers need.

Workers are started by PyTorch's own launcher (``torch.distributed.run``): ``lingctl train --nproc N`` starts
it on this machine (``supervise/launch.py``), and ``torchrun ... -m lingctl train`` on many machines works the
same way, since a worker only reads the usual ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR``
variables. gloo on CPU, NCCL on CUDA.

Data: rank ``r`` of ``W`` reads the global batch order at positions ``r, r + W, r + 2W, ...`` of its own
cursor, so workers never read the same row in an epoch and a worker's stream depends only on the seed, its
rank and how many rows it has read (a resume needs only the cursor).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lingctl.train.supervise.torchrun import ATTEMPT_ENV

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Workers:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    restarts: int = 0  # how often the job was restarted (LINGCTL_ATTEMPT, or torchrun's TORCHELASTIC_RESTART_COUNT)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- agreements ---------------------------------------------------------------------------------
    def any(self, flag: bool) -> bool:
        """True on every worker when it is true on one (a stop request, a time limit)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def mean(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def gather(self, values: list[float]) -> np.ndarray:
        """Every worker's ``values`` as a [world, len(values)] array, on every worker."""
        row = torch.tensor(values, dtype=torch.float64)
        if not self.distributed:
            return row.numpy()[None, :]
        out = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(out, row)
        return torch.stack(out).numpy()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every worker (small objects: a tokenizer, a decision)."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def start() -> Workers:
    """Join the job's process group when started as one of several workers; one worker otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Workers()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    # lingctl's launcher restarts the job itself (torchrun runs each attempt with --max-restarts=0) and says
    # which attempt this is; a job under a user's own torchrun counts torchrun's restarts.
    restarts = max(
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), int(os.environ.get(ATTEMPT_ENV, "0") or 0)
    )
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, store=_attempt_store(rank, world, restarts), rank=rank, world_size=world)
    # Workers share this machine's cores: oversubscribed OpenMP threads make a step many times slower.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    workers = Workers(rank=rank, world=world, local_rank=local_rank, restarts=restarts)
    log.debug("worker %d of %d (local %d, restart %d)", rank, world, local_rank, workers.restarts)
    return workers


def _attempt_store(rank: int, world: int, restarts: int) -> dist.Store:
    """The rendezvous store of this attempt. Under torchrun the workers share the launcher's store, which
    outlives a restart: without a prefix per attempt, a restarted worker can read the addresses the
    previous attempt's (dead) workers left there and fail to connect."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timedelta(minutes=10),
    )
    return dist.PrefixStore(f"lingctl/attempt-{restarts}", store)


def stop(workers: Workers) -> None:
    if workers.distributed and dist.is_initialized():
        dist.destroy_process_group()


def strided_rows(indices: Any, cursor: int, count: int, rank: int, world: int) -> list[int]:
    """Rows of this worker's positions ``cursor .. cursor + count - 1`` in its stride of the global order
    (``indices(start, n)`` is ``BatchOrder.indices``)."""
    if world == 1:
        return indices(cursor, count).tolist()
    return indices(cursor * world, count * world)[rank::world].tolist()
