"""One attempt of a multi-worker job as PyTorch's elastic launcher runs it: its command line, the workers'
environment, and what its stderr says about the workers that failed.

The launcher (``agent.py``) runs one ``torch.distributed.run --max-restarts=0`` per attempt; a worker learns
from its environment which attempt it is in (``ATTEMPT_ENV``, read by ``workers.start``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from lingctl.core.errors import UsageError

ATTEMPT_ENV = "LINGCTL_ATTEMPT"  # the attempt (0, 1, ...) each worker of a job started by lingctl is in


def launch_env(nproc: int, attempt: int = 0) -> dict[str, str]:
    """The workers' environment: their attempt, one share of the cores each (set here, so torchrun does not
    print its notice about it), and PyTorch's C++ warnings off (DDP warns once per worker that an MoE step
    happened to route a token to every expert)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env[ATTEMPT_ENV] = str(attempt)
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


def relay_stderr(stream: Any, codes: list[int], failures: list[tuple[int, int]] | None = None) -> None:
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
