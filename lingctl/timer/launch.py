"""``timer run``: run a command with every Python process it starts traced.

The command gets ``LINGCTL_TIMER_OUT``/``LINGCTL_TIMER_TARGETS`` and a PYTHONPATH that starts with
``_inject`` (whose ``sitecustomize`` installs the tracer at interpreter start, in torchrun's workers as in
the launcher) and lingctl's own parent directory (so the import works from any environment that has
lingctl's dependencies).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.timer.ring import ensure_ring_dir
from lingctl.timer.tracer import parse_targets

INJECT_DIR = Path(__file__).resolve().parent / "_inject"
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def traced_env(out: Path, targets: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["LINGCTL_TIMER_OUT"] = str(Path(out).resolve())
    env["LINGCTL_TIMER_TARGETS"] = targets or "default"
    paths = [str(INJECT_DIR), str(PACKAGE_PARENT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def run_traced(cmd: list[str], *, out: Path, targets: str | None) -> int:
    """Run ``cmd`` traced; its exit code (``128 + N`` when killed by signal N, as a shell reports it).

    SIGTERM is forwarded to the child, and so is SIGINT unless it came from the terminal, which already
    delivers it to the child (same process group)."""
    if not cmd:
        raise ValueError("no command to run")
    parse_targets(targets)  # a typo fails here, not in every child
    # A ring directory that is not ours is refused here, once, rather than by every traced child.
    ensure_ring_dir()
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(cmd, env=traced_env(out, targets))
    except FileNotFoundError:
        raise NotFoundError(f"command not found: {cmd[0]}") from None
    except PermissionError:
        raise LingctlError(f"cannot execute {cmd[0]}: permission denied") from None
    try:
        with _forwarding_signals(proc):
            rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 128 - rc if rc < 0 else rc


@contextmanager
def _forwarding_signals(proc: subprocess.Popen) -> Iterator[None]:
    """SIGINT and SIGTERM go on to ``proc`` while inside (off the main thread, where handlers cannot be set,
    nothing is forwarded); the previous handlers come back after."""

    def forward(signum, frame):
        if signum == signal.SIGINT and _terminal_foreground():
            return
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, forward)
            except ValueError:  # not the main thread: no forwarding
                pass
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _terminal_foreground() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False
