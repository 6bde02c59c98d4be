"""Run N ``torch.distributed`` gloo processes on 127.0.0.1 and collect what each returns.

``run_workers(fn, 2, *args)`` starts two spawned processes, each with an initialised gloo process group
(rank, world size, a free port) and one intra-op thread (two cores are easily oversubscribed), calls
``fn(rank, world_size, *args)`` and returns the results in rank order. A worker that raises fails the call
with its traceback; workers still alive at the timeout are killed, so no test leaves processes behind.
``fn`` must be importable (defined at module level).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from lingctl.core.net import free_port


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="lingctl-dist-") as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} gloo workers still running after {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
