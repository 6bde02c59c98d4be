"""Several training workers: the process group, who reads which rows, and the few agreements workers need.

Workers are started by PyTorch's own launcher (``torch.distributed.run``): ``lingctl train --nproc N`` starts
it on this machine, and ``torchrun ... -m lingctl train`` on many machines works the same way, since a
worker only reads the usual ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` variables. gloo on
CPU, NCCL on CUDA.

Data: rank ``r`` of ``W`` reads the global batch order at positions ``r, r + W, r + 2W, ...`` of its own
cursor, so workers never read the same row in an epoch and a worker's stream depends only on the seed, its
rank and how many rows it has read (a resume needs only the cursor).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lingctl.core.errors import UsageError
from lingctl.train.supervise.agent import ATTEMPT_ENV

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


def launch_env(nproc: int) -> dict[str, str]:
    """The workers' environment: one share of the cores each (set here, so torchrun does not print its
    notice about it), and PyTorch's C++ warnings off (DDP warns once per worker that an MoE step happened
    to route a token to every expert)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def launch_argv(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs one attempt of ``lingctl train ARGV`` as ``nproc`` workers under torch's elastic
    launcher. torchrun never restarts them itself: lingctl's launcher decides (agent.py)."""
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        "lingctl",
        "train",
        *argv,
    ]


def strided_rows(indices: Any, cursor: int, count: int, rank: int, world: int) -> list[int]:
    """Rows of this worker's positions ``cursor .. cursor + count - 1`` in its stride of the global order
    (``indices(start, n)`` is ``BatchOrder.indices``)."""
    if world == 1:
        return indices(cursor, count).tolist()
    return indices(cursor * world, count * world)[rank::world].tolist()


# The launcher's own options: with a value, and flags.
LAUNCHER_OPTIONS = ("--nproc", "--max-restarts", "--hang-timeout")
LAUNCHER_FLAGS = ("--watchdog", "--no-watchdog")


def worker_args(argv: list[str]) -> list[str]:
    """The ``train`` options of a command line, without the launcher's own (--nproc, --max-restarts,
    --hang-timeout, --watchdog/--no-watchdog)."""
    args = argv[argv.index("train") + 1 :] if "train" in argv else list(argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in LAUNCHER_OPTIONS:
            skip = True
        elif arg not in LAUNCHER_FLAGS and not arg.startswith(tuple(f"{o}=" for o in LAUNCHER_OPTIONS)):
            kept.append(arg)
    return kept


def launch(
    nproc: int,
    max_restarts: int | None,
    argv: list[str],
    *,
    watchdog: bool | None = None,
    hang_timeout_s: float | None = None,
    out: str | None = None,
    cache_dir: Path | None = None,
    preset: str | None = None,
) -> int:
    """Run ``lingctl [...] train ARGV`` as ``nproc`` workers under torch's elastic launcher, restarting them
    after a crash or a hang while the budget lasts (agent.py); the job's exit code.

    ``argv`` is this process's command line; the launcher's own options are taken out, everything else
    reaches every worker unchanged. ``max_restarts`` None: 3 with the watchdog on, else 0; ``watchdog``
    None: on for more than one worker. ``out`` (None: the default name, chosen here so that every attempt
    writes into the same run) and ``cache_dir`` locate the run's local directory, where incidents are
    recorded. Ctrl-C, SIGINT, SIGTERM and SIGHUP to this process are passed on to torchrun, which passes them
    to the workers (they finish their step, save and exit; ``signal_relay.py``). None is followed by a restart.
    """
    from lingctl.train.supervise.agent import Job, JobOptions

    args = worker_args(argv)
    if out is None and "--resume" not in args:  # --resume without --out stays the workers' usage error
        from lingctl.train.run import default_out

        out = default_out(preset or "small")
        args += ["--out", out]
    given = _setting(args, "watchdog")
    if watchdog is None and given is not None:  # `--set watchdog=false` turns the launcher's off too
        watchdog = given.lower() in ("true", "1", "yes", "on")
    options = JobOptions(
        nproc=nproc,
        max_restarts=max_restarts,
        watchdog=watchdog,
        hang_timeout_s=hang_timeout_s,
        run_local=run_local(out, cache_dir) if out is not None else None,
    )
    if given is None and _has_setting("watchdog"):  # the workers' own checks follow the launcher's choice
        args += ["--set", f"watchdog={'true' if options.watching else 'false'}"]
    return Job(args, options).run()


def run_local(out: str, cache_dir: Path | None = None) -> Path:
    """The local directory of the run at ``out``: itself, or for an s3:// run its staging directory."""
    from lingctl.core.storage import parse_url
    from lingctl.train.rundir import staging_dir

    url = parse_url(out)
    return staging_dir(url, cache_dir) if url.is_s3 else url.path


def _setting(args: list[str], key: str) -> str | None:
    """The value the last ``--set KEY=VALUE`` among ``args`` gives ``key``, if any."""
    found = None
    for i, arg in enumerate(args):
        item = args[i + 1] if arg == "--set" and i + 1 < len(args) else arg.removeprefix("--set=")
        if (arg == "--set" or arg.startswith("--set=")) and item.split("=", 1)[0].strip() == key and "=" in item:
            found = item.split("=", 1)[1].strip()
    return found


def _has_setting(name: str) -> bool:
    import dataclasses

    from lingctl.train.config import TrainConfig

    return name in {f.name for f in dataclasses.fields(TrainConfig)}


def job_exit_code(codes: list[int]) -> int:
    """The job's exit code from its failed workers' codes (the launcher's root cause first): the first failed
    worker's code (2 bad settings, 3 not found, ...). A worker whose peer stopped fails too, with code 1, and
    may be the first observed; a more specific code from another worker says more."""
    failed = [c for c in codes if c > 0]
    return next((c for c in failed if c != 1), failed[0] if failed else 1)


# torchrun's own log lines ("W1202 16:29:24.788000 7255 torch/distributed/...") and its failure report.
_LAUNCHER_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def _relay(stream: Any, codes: list[int], failures: list[tuple[int, int]] | None = None) -> None:
    """Pass the workers' stderr through, holding back the launcher's logs and traceback report (but noting
    the exit codes it lists, and in ``failures`` each failed worker's (rank, exit code))."""
    in_report = root = False
    rank = -1
    for line in stream:
        if line.startswith("Traceback (most recent call last):") or line.startswith("====="):
            in_report = True
        if in_report or _LAUNCHER_LOG.match(line):
            root = root or line.startswith("Root Cause")
            found_rank = _RANK.match(line)
            if found_rank:
                rank = int(found_rank.group(1))
            found = _EXITCODE.match(line)
            if found:  # the report's root cause (the first worker to fail) goes first
                at = 0 if root else len(codes)
                codes.insert(at, int(found.group(1)))
                if failures is not None:
                    failures.insert(at, (rank, int(found.group(1))))
                root = False
            continue
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):
            # The terminal is gone (SIGHUP) or stderr closed: keep draining, or torchrun and the workers would
            # block on a full pipe while they save.
            pass
