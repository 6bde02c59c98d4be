"""Ray, imported only when ``--ray`` asks for it, and the connection to the cluster."""

from __future__ import annotations

import logging
from types import ModuleType

from lingctl.core.errors import UsageError

log = logging.getLogger(__name__)

EXTRA_HINT = "install it with: pip install 'lingctl[ray]' (on every node of the cluster)"


def import_ray() -> ModuleType:
    """The ``ray`` module, or a one-line error naming the extra that brings it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray, which is not installed", hint=EXTRA_HINT) from None
    return ray


def connect(address: str | None) -> ModuleType:
    """Connect this process to the cluster at ``address`` and return ``ray``.

    None follows Ray's own rule, as ``ray.init()`` does: ``RAY_ADDRESS`` when set, else the cluster last
    started on this machine (``ray start --head``), else a new single-node cluster in this process, which ends
    with it. Engines' logs stay on their nodes (``/tmp/ray/session_latest/logs``); errors reach the driver."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    _cluster_messages_to_log(ray)
    try:
        ray.init(
            address=address,
            logging_level=logging.WARNING,
            log_to_driver=False,
            include_dashboard=False,
            configure_logging=True,
        )
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = address or "RAY_ADDRESS / a local cluster"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--ray: cannot connect to the Ray cluster at {where}: {first}",
            hint="start it with 'ray start --head' (then 'ray start --address HEAD:6379' on each node), "
            "or give --ray-address",
        ) from None
    return ray


def _cluster_messages_to_log(ray: ModuleType) -> None:
    """Ray's driver prints the cluster's error messages (a node's raylet died, ...) to stdout, where lingctl
    writes only results (``--json``, ``-o -``): they go to lingctl's log on stderr instead, first line as a
    warning, the rest (a raylet's last log lines) at debug level."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    if worker is None or not callable(getattr(worker, "print_to_stdstream", None)):
        return

    def to_log(data: dict[str, object], ignore_prefix: bool = False) -> None:
        lines = data.get("lines")
        for text in lines if isinstance(lines, list) else []:
            first, _, rest = str(text).strip().partition("\n")
            log.warning("ray (%s): %s", data.get("pid", "cluster"), first)
            if rest:
                log.debug("%s", rest)

    worker.print_to_stdstream = to_log
