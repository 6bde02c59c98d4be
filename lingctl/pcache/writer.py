"""``PCacheWriter``: a DCP storage writer that stages only this rank's items, through one bounded buffer.

Files are DCP's own format (one ``__RANK_0.distcp`` per writing rank, each item a ``torch.save`` record,
``.metadata`` by temp + rename), so stock ``dcp.load`` / ``FileSystemReader`` read them. What differs:

- Memory. A contiguous CPU tensor, or a row chunk of one, is serialised straight from the live memory: no
  copy. Anything else (a strided view, a device tensor) is copied into one preallocated buffer and written
  from there, so the extra memory of a save is about one buffer whatever
  the checkpoint size (``dcp.async_save`` copies the rank's whole state first; docs: FACTS). Chunks larger
  than the buffer cannot occur with ``PCacheSavePlanner``'s chunk size <= buffer; if another planner hands
  one over, it is copied on its own and the fact is logged.
- Integrity. Each data file's size and CRC64NVME are computed while it is written and kept in a sidecar
  ``__RANK.pcache.json``; after DCP's ``.metadata``, the coordinator writes the commit marker
  ``pcache.json`` (every file with size and CRC) by temp + rename. A directory without the marker is an
  incomplete save; the marker is what the flash tier uploads last and what readers verify against.
- Crash safety. Each save goes to its own directory; a committed one is never overwritten, and leftovers
  of an earlier failed attempt at the same directory are removed before anything is written.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lingctl.core.atomic import atomic_write
from lingctl.core.checksum import Crc64, crc64_file
from lingctl.core.errors import UsageError
from lingctl.pcache.marker import DATA_SUFFIX, MARKER, METADATA, RANK_PREFIX, data_prefix, marker_bytes, sidecar_name
from lingctl.pcache.save_planner import item_bytes
from lingctl.pcache.throttle import NodeThrottle, Throttles

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 64 << 20
_THROTTLE_GRAIN = 1 << 20  # emulated bandwidth is charged per MiB, not per small pickle write
_FILE_KEY = "\0pcache-file:"


class _Sink(io.RawIOBase):
    """The data file as torch.save sees it: counts bytes, updates the CRC and charges the throttle."""

    def __init__(self, f: Any, throttle: NodeThrottle | Throttles | None) -> None:
        super().__init__()
        self.f = f
        self.crc = Crc64()
        self.position = 0
        self.throttle = throttle
        self._unbilled = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        self.f.write(view)
        self.crc.update(view)
        self.position += n
        if self.throttle is not None:
            self._unbilled += n
            if self._unbilled >= _THROTTLE_GRAIN:
                self.throttle.consume(self._unbilled)
                self._unbilled = 0
        return n

    def tell(self) -> int:
        return self.position

    def finish(self) -> None:
        if self.throttle is not None:
            if self._unbilled:
                self.throttle.consume(self._unbilled)
                self._unbilled = 0
            self.throttle.drain()
        self.f.flush()


class StagingBuffer:
    """One preallocated byte buffer that non-contiguous, partial or device tensors are copied through."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf: np.ndarray | None = None  # allocated on first use: a save of plain tensors needs none
        self.copied_bytes = 0
        self.oversize_items = 0

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a CPU tensor whose storage is exactly its bytes (torch.save writes whole storages)."""
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.is_cpu and tensor.is_contiguous():
            if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes:
                return tensor
            if nbytes:
                # A contiguous slice of a larger tensor (a row chunk): alias exactly its bytes through numpy,
                # whose from_numpy storage covers only the array it is given. No copy.
                raw = tensor.reshape(-1).view(torch.uint8).numpy()
                return torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)
        self.copied_bytes += nbytes
        if nbytes > self.nbytes:
            self.oversize_items += 1
            log.info("item of %d bytes exceeds the %d-byte staging buffer; copied on its own", nbytes, self.nbytes)
            return tensor.to("cpu").contiguous().clone()
        if self._buf is None:
            self._buf = np.empty(self.nbytes, dtype=np.uint8)
        # from_numpy over a slice gives a storage of exactly nbytes; torch.save then writes only those.
        view = torch.from_numpy(self._buf[:nbytes]).view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        return view


class PCacheWriter(FileSystemWriter):
    """Write a DCP checkpoint into ``path`` (one directory per checkpoint)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        throttle: NodeThrottle | Throttles | None = None,
        sync_files: bool = True,
        extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1, overwrite=True)
        self.buffer = StagingBuffer(buffer_bytes)
        self.throttle = throttle
        # Stored in the commit marker (the plan's figures, a training step); a callable is asked at commit.
        self.extra = extra or {}
        self.written_bytes = 0
        self.write_seconds = 0.0
        self.rank_in_group = 0

    @property
    def directory(self) -> Path:
        return Path(self.path)

    # -- planning ---------------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if (self.directory / MARKER).exists():
            raise UsageError(
                f"{self.directory} already holds a committed checkpoint",
                hint="save each checkpoint to its own directory",
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator after every rank has planned and before any rank writes: the moment to
        # clear what a failed earlier attempt at this directory left (its files would not be in the new
        # metadata, but they would be uploaded and counted).
        for entry in self.directory.iterdir():
            if entry.is_file() and (entry.name.startswith(RANK_PREFIX) or entry.name.startswith(METADATA)):
                entry.unlink(missing_ok=True)
        return [
            p
            if p.storage_data is not None
            else SavePlan(p.items, storage_data=_StoragePrefix(data_prefix(i)), planner_data=p.planner_data)
            for i, p in enumerate(plans)
        ]

    # -- writing ----------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        start = time.monotonic()
        prefix: _StoragePrefix = plan.storage_data
        rank = int(prefix.prefix.strip("_"))
        results: list[WriteResult] = []
        files: dict[str, dict[str, Any]] = {}
        if plan.items:
            name = f"{prefix.prefix}0{DATA_SUFFIX}"
            with open(self.directory / name, "wb", buffering=1 << 20) as f:
                sink = _Sink(f, self.throttle)
                # Small non-tensor values first, then tensors largest first (the order DCP's writer uses).
                ordered = sorted(plan.items, key=lambda i: (i.type != WriteItemType.BYTE_IO, -item_bytes(i)))
                for item in ordered:
                    offset = sink.tell()
                    data = planner.resolve_data(item)
                    # DCP resolves BYTE_IO items to BytesIO and every other item to a tensor.
                    if item.type == WriteItemType.BYTE_IO:
                        sink.write(cast(io.BytesIO, data).getbuffer())
                    else:
                        # _Sink is a RawIOBase with the write/tell torch.save uses; typeshed wants IO[bytes].
                        torch.save(self.buffer.stage(cast(torch.Tensor, data)), sink)  # type: ignore[arg-type]
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=sink.tell() - offset,
                            storage_data=_StorageInfo(name, offset, sink.tell() - offset),
                        )
                    )
                sink.finish()
                if self.sync_files:
                    os.fsync(f.fileno())
            files[name] = {"size": sink.position, "crc64nvme": sink.crc.tagged()}
            self.written_bytes += sink.position
        side = self.directory / sidecar_name(rank)
        with atomic_write(side) as (_, f):
            f.write(json.dumps({"rank": rank, "files": files}).encode())
        files[side.name] = {"size": side.stat().st_size, "crc64nvme": crc64_file(side).tagged()}
        # The coordinator may be on another node and cannot read these files: their sizes and CRCs travel
        # to it with the write results, under keys that finish() takes out before DCP's metadata is saved.
        for fname, info in files.items():
            results.append(
                WriteResult(
                    index=MetadataIndex(_FILE_KEY + fname),
                    size_in_bytes=info["size"],
                    storage_data=_StorageInfo(fname, 0, info["size"], [info["crc64nvme"]]),
                )
            )
        self.write_seconds += time.monotonic() - start
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, dict[str, Any]] = {}
        data_results = []
        for rank_results in results:
            kept = []
            for wr in rank_results:
                if wr.index.fqn.startswith(_FILE_KEY):
                    info: _StorageInfo = wr.storage_data
                    assert info.transform_descriptors is not None  # file results carry their CRC (write_data)
                    files[info.relative_path] = {"size": info.length, "crc64nvme": info.transform_descriptors[0]}
                else:
                    kept.append(wr)
            data_results.append(kept)
        super().finish(metadata, data_results)  # .metadata via temp + rename
        meta = self.directory / METADATA
        files[METADATA] = {"size": meta.stat().st_size, "crc64nvme": crc64_file(meta).tagged()}
        extra = self.extra() if callable(self.extra) else self.extra
        with atomic_write(self.directory / MARKER) as (_, f):
            f.write(marker_bytes(len(results), files, extra))
