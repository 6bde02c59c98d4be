"""The ``--ray`` options that ``flood run`` and ``flood eval`` share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from lingctl.core.errors import UsageError

if TYPE_CHECKING:
    from lingctl.flood.cluster.options import ClusterOptions

RayOpt = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Run the engines on a Ray cluster (needs the lingctl[ray] extra on every node): RAY_ADDRESS, else "
        "the cluster started on this machine, else a new one here. The output is the same file as without --ray.",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        metavar="ADDRESS",
        help="The cluster to use: auto, HOST:PORT (the head's GCS port, 6379 by default) or ray://HOST:PORT; "
        "implies --ray.",
    ),
]
RayCpusOpt = Annotated[
    float | None,
    typer.Option(
        "--ray-cpus-per-engine",
        metavar="N",
        help="CPUs per engine (default: one engine per node, holding all its CPUs); threads are chosen within them.",
    ),
]
RayEnginesOpt = Annotated[
    int | None, typer.Option("--ray-engines", metavar="N", help="At most N engines (default: as many as fit).")
]
RayBlockOpt = Annotated[
    int | None,
    typer.Option(
        "--ray-block",
        metavar="N",
        help="Requests per block sent to an engine (default: about 4 blocks per engine, at least 2 x --max-seqs "
        "unless an engine would get none, at most 1024).",
    ),
]


def cluster_options(
    ray: bool, address: str | None, cpus: float | None, engines: int | None, block: int | None
) -> ClusterOptions | None:
    """The cluster settings, or None to run here. Any --ray-* option without --ray is refused, except the
    address, which asks for the cluster by itself."""
    if not ray and address is None:
        given = [
            flag
            for flag, v in (("--ray-cpus-per-engine", cpus), ("--ray-engines", engines), ("--ray-block", block))
            if v is not None
        ]
        if given:
            raise UsageError(f"{given[0]} applies to --ray runs only", hint="add --ray")
        return None
    from lingctl.flood.cluster.options import ClusterOptions  # loads flood only when a command runs

    return ClusterOptions(address=address, cpus_per_engine=cpus, engines=engines, block_requests=block)
