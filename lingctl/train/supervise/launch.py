"""``lingctl train --nproc N``: the launcher's entry, from the command line to the job's restart loop.

The launcher's own options (--nproc, --max-restarts, --hang-timeout, --watchdog/--no-watchdog) are taken out of
the command line; everything else reaches every worker unchanged (``torchrun.py`` runs them, ``agent.py``
decides about restarts).
"""

from __future__ import annotations

from pathlib import Path

from lingctl.runs.layout import default_run_dir, local_dir
from lingctl.runs.train_config import TrainConfig
from lingctl.train.supervise.agent import Job, JobOptions

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
    args = worker_args(argv)
    if out is None and "--resume" not in args:  # --resume without --out stays the workers' usage error
        out = default_run_dir(preset or TrainConfig().preset)
        args += ["--out", out]
    given = _setting(args, "watchdog")
    if watchdog is None and given is not None:  # `--set watchdog=false` turns the launcher's off too
        watchdog = given.lower() in ("true", "1", "yes", "on")
    options = JobOptions(
        nproc=nproc,
        max_restarts=max_restarts,
        watchdog=watchdog,
        hang_timeout_s=hang_timeout_s,
        run_local=local_dir(out, cache_dir) if out is not None else None,
    )
    if given is None:  # the workers' own checks (rollbacks) follow the launcher's choice
        args += ["--set", f"watchdog={'true' if options.watching else 'false'}"]
    return Job(args, options).run()


def _setting(args: list[str], key: str) -> str | None:
    """The value the last ``--set KEY=VALUE`` among ``args`` gives ``key``, if any."""
    found = None
    for i, arg in enumerate(args):
        item = args[i + 1] if arg == "--set" and i + 1 < len(args) else arg.removeprefix("--set=")
        if (arg == "--set" or arg.startswith("--set=")) and item.split("=", 1)[0].strip() == key and "=" in item:
            found = item.split("=", 1)[1].strip()
    return found
