"""Save and load distributed checkpoints the pcache way: the public API that ``lingctl train`` uses.

``save(state, "s3://bucket/run/step-100", cache_dir="/nvme/cache")`` writes this rank's share (as the
planner decided) into the node-local cache at local-disk speed and returns; the uploader copies it to the
destination in the background, the commit marker last. A local or shared-filesystem destination without a
cache dir is written in place. ``load`` reads through ``local_copy.resolve_for_read``: the local copy when it
is complete and verified, else what the remote holds; then through ``safe_reader.SafeReader``, so that
nothing in the checkpoint runs as code.

Errors that DCP collects from all ranks come back as one ``CheckpointException``; the first lingctl error in
it is re-raised as itself, so the command line shows one line, not every rank's traceback.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lingctl.core.errors import LingctlError, VerificationError
from lingctl.core.storage import S3Options, parse_url
from lingctl.pcache import tier
from lingctl.pcache.local_copy import cache_path, resolve_for_read
from lingctl.pcache.marker import MARKER, read_marker
from lingctl.pcache.safe_reader import SafeReader, refusal_reason
from lingctl.pcache.save_planner import DEFAULT_CHUNK_BYTES, PCacheSavePlanner, PlanSummary
from lingctl.pcache.throttle import NodeThrottle
from lingctl.pcache.topology import Topology
from lingctl.pcache.writer import DEFAULT_BUFFER_BYTES, PCacheWriter

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SaveResult:
    local_dir: str  # where this rank wrote
    remote: str | None  # where the uploader copies it (None: the local directory is the destination)
    written_bytes: int  # by this rank
    seconds: float  # the blocking part: planning and the local write
    plan: PlanSummary | None = None  # on the coordinator


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns on every call that it assumes one process: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _unwrap(exc: CheckpointException) -> Exception:
    # DCP keeps each rank's failure as (exception, traceback).
    failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    for failure in failures:
        if isinstance(failure, LingctlError):
            return failure
    for failure in failures:
        if isinstance(failure, pickle.UnpicklingError):  # torch.load(weights_only=True) refused a tensor record
            return VerificationError(
                f"checkpoint data refused on rank(s) {sorted(exc.failures)}: {refusal_reason(failure)}",
                hint="the checkpoint was tampered with; do not use it",
            )
    first = failures[0] if failures else exc
    return LingctlError(f"checkpoint failed on rank(s) {sorted(exc.failures)}: {type(first).__name__}: {first}")


def save(
    state_dict: dict[str, Any],
    destination: str | Path,
    *,
    cache_dir: Path | str | None = None,
    s3: S3Options | None = None,
    uploader: tier.Uploader | None = None,
    topology: Topology | None = None,
    ranks_per_node: int | None = None,
    node_bandwidth: float | list[float] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    throttle: NodeThrottle | None = None,
    extra: dict[str, Any] | None = None,
    process_group: Any = None,
    on_durable: Any = None,
) -> SaveResult:
    """Write one checkpoint (every rank calls this, as with ``dcp.save``).

    ``destination`` is a directory or ``s3://`` URL of its own per checkpoint. With a remote destination
    (s3://, or a path while ``cache_dir`` is given) the write goes to the cache and is uploaded: by
    ``uploader`` in the background when given (``on_durable(url)`` runs once the marker is up), else before
    this returns.
    """
    start = time.monotonic()
    url = str(destination)
    remote = url if parse_url(url).is_s3 or cache_dir is not None else None
    local = cache_path(url, cache_dir) if remote is not None else parse_url(url).path.absolute()
    planner = PCacheSavePlanner(
        topology=topology,
        ranks_per_node=ranks_per_node,
        node_bandwidth=node_bandwidth,
        chunk_bytes=min(chunk_bytes, buffer_bytes),
    )
    # A topology that does not fit the job is a usage error on every rank, before anything is written.
    world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
    planner.topology_for(world)
    writer = PCacheWriter(
        local, buffer_bytes=buffer_bytes, throttle=throttle, extra=lambda: _marker_extra(planner.summary, extra)
    )
    try:
        with _quiet_single_process():
            dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)
    except CheckpointException as exc:
        raise _unwrap(exc) from None
    seconds = time.monotonic() - start
    rank = _rank()
    if remote is not None:
        _hand_over(local, remote, s3, rank=rank, uploader=uploader, on_durable=on_durable)
    log.debug("rank %d wrote %d bytes of %s in %.2f s", rank, writer.written_bytes, local, seconds)
    return SaveResult(
        local_dir=str(local),
        remote=remote,
        written_bytes=writer.written_bytes,
        seconds=round(seconds, 4),
        plan=planner.summary,
    )


def _marker_extra(plan: PlanSummary | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """What the commit marker records beside the files: the plan's figures (on the coordinator), then
    ``extra``."""
    figures = (
        {
            "plan": {
                "node_bytes": plan.node_bytes,
                "rank_bytes": plan.rank_bytes,
                "estimated_s": plan.estimated_s,
                "items": plan.items,
            }
        }
        if plan
        else {}
    )
    return {**figures, **(extra or {})}


def _hand_over(
    local: Path,
    remote: str,
    s3: S3Options | None,
    *,
    rank: int,
    uploader: tier.Uploader | None,
    on_durable: Any,
) -> None:
    """This rank's part of the upload of what it wrote: queued on ``uploader``, else done now (the
    coordinator, rank 0, also sends the marker)."""
    finalize = rank == 0
    if uploader is not None:
        uploader.submit(local, remote, s3, rank=rank, finalize=finalize, on_durable=on_durable)
        return
    tier.upload(local, remote, s3, rank=rank, finalize=finalize)
    if finalize and on_durable is not None:
        on_durable(remote)


def load(
    state_dict: dict[str, Any],
    source: str | Path,
    *,
    cache_dir: Path | str | None = None,
    s3: S3Options | None = None,
    process_group: Any = None,
) -> Path:
    """Load ``state_dict`` in place from a checkpoint (any world size; DCP reshards). Returns the local
    directory read. With an s3:// source, one rank per node brings the files into the cache first.

    Nothing from the checkpoint runs as code, and nothing unverified is read: one rank per node checks every
    file against the marker (size and CRC64NVME, all bytes) and every rank learns the outcome; ``.metadata``
    is checked again on the bytes that are unpickled, through an unpickler that builds only DCP's metadata
    classes, and other non-tensor items load with ``weights_only=True`` (``safe_reader``). A file that fails
    is a ``VerificationError`` (exit code 4) naming it.
    """
    url = str(source)
    parsed = parse_url(url)
    local = cache_path(url, cache_dir) if parsed.is_s3 else parsed.path.absolute()
    multi = dist.is_available() and dist.is_initialized()
    failure: LingctlError | None = None
    if not multi or int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
        try:
            resolve_for_read(url, cache_dir=local if parsed.is_s3 else None, s3=s3, exact=True)
        except LingctlError as exc:
            failure = exc
    if multi:
        failure = _first_failure(failure, process_group)  # also the barrier: nobody reads before it is checked
    if failure is not None:
        raise failure
    reader = SafeReader(local, files=_marker_files(local))  # the marker may be gone since it was verified
    reader.read_metadata()  # here, so that a refusal is raised as itself rather than inside DCP's collectives
    try:
        with _quiet_single_process():
            dcp.load(state_dict, storage_reader=reader, process_group=process_group)
    except CheckpointException as exc:
        raise _unwrap(exc) from None
    return local


def _first_failure(mine: LingctlError | None, group: Any) -> LingctlError | None:
    """The first failure any rank of ``group`` had (this one's own if it had one), so that all raise together."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, None if mine is None else (type(mine), mine.message, mine.hint), group=group)
    if mine is not None:
        return mine
    for failure in everyone:
        if failure is not None:
            kind, message, hint = failure
            return kind(message, hint=hint)
    return None


def saved_keys(directory: str | Path) -> set[str]:
    """The flattened state-dict keys a local checkpoint holds (``optimizer.state.<fqn>.step`` ...), read from its
    verified-safe metadata: a caller loads only what is there (an optimizer has no state for a parameter that
    never had a gradient before the save)."""
    local = Path(directory)
    return set(SafeReader(local, files=_marker_files(local)).read_metadata().state_dict_metadata)


def _marker_files(local: Path) -> dict[str, dict]:
    """The files the commit marker of ``local`` lists; ``VerificationError`` when it has none."""
    marker = read_marker(local)
    if marker is None:
        raise VerificationError(f"{local}: incomplete checkpoint (no {MARKER})")
    return marker["files"]
