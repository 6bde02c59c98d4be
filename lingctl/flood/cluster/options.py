"""What ``--ray`` and its companions ask for. Plain data: reading it needs no Ray."""

from __future__ import annotations

from dataclasses import dataclass

from lingctl.core.errors import UsageError


@dataclass(kw_only=True, slots=True)
class ClusterOptions:
    # Where the cluster is: None follows Ray's own rule (RAY_ADDRESS, else a cluster started on this machine,
    # else a new one here); "auto", "HOST:PORT" or "ray://HOST:PORT" as Ray reads them.
    address: str | None = None
    cpus_per_engine: float | None = None  # None: one engine per node, holding all its CPUs
    engines: int | None = None  # at most this many engines (None: as many as the nodes hold)
    block_requests: int | None = None  # requests per block sent to an engine (None: chosen from the batch)
    in_flight: int = 2  # blocks queued per engine, so it never waits for the driver between two

    def validate(self) -> None:
        if self.cpus_per_engine is not None and self.cpus_per_engine <= 0:
            raise UsageError(f"--ray-cpus-per-engine must be > 0, got {self.cpus_per_engine:g}")
        if self.engines is not None and self.engines < 1:
            raise UsageError(f"--ray-engines must be >= 1, got {self.engines}")
        if self.block_requests is not None and self.block_requests < 1:
            raise UsageError(f"--ray-block must be >= 1, got {self.block_requests}")
