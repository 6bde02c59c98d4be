"""Reading DCP checkpoints without running code from them.

Stock DCP unpickles ``.metadata`` with ``pickle.load`` and its default load planner decodes non-tensor items
with ``torch.load(weights_only=False)``: a crafted file in either place runs whatever it asks for when the
checkpoint is loaded. ``SafeReader`` reads the same files (stock DCP checkpoints included, on any world size)
with two changes:

- ``.metadata`` goes through ``MetadataUnpickler``, which builds only the classes a DCP metadata file is made
  of (the dataclasses of ``torch.distributed.checkpoint.metadata``, ``torch.Size``, dtypes and layouts, plain
  containers, paths) and refuses every other global; nothing is called but those classes' constructors.
- byte items (anything in the state dict that is not a tensor) are decoded with
  ``torch.load(weights_only=True)``: tensors and plain Python data only.

Given the checkpoint's marker file list (``files``), it also refuses a ``.metadata`` whose bytes do not match
their recorded size and CRC64NVME (checked on the bytes it then unpickles, so nothing can change them in
between), and a metadata file that points DCP at any file the marker does not list. Refusals are
``VerificationError`` (exit code 4) naming the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lingctl.core.checksum import crc64_bytes
from lingctl.core.errors import LingctlError, VerificationError, os_error
from lingctl.core.names import check_relative, printable
from lingctl.pcache.marker import MARKER, METADATA

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

# Every global a DCP metadata file of torch 2.13 refers to (dtypes are checked apart, below). Functions are
# left out on purpose, except torch.serialization._get_layout, which only looks a layout up by its name.
ALLOWED_GLOBALS = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("builtins", "complex"),
    }
)


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``ALLOWED_GLOBALS`` and torch dtypes; ``where`` names the file."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise VerificationError(
            f"{self.where}: refers to {printable(module)}.{printable(name)}, which a DCP metadata file never "
            "holds; refusing to load it (it could run code)",
            hint="the checkpoint was not written by DCP or was tampered with; do not use it",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise VerificationError(
            f"{self.where}: holds a persistent reference, which a DCP metadata file never holds; refusing to load it",
            hint="the checkpoint was tampered with",
        )


def load_metadata(data: bytes, where: str) -> Metadata:
    """The DCP ``Metadata`` pickled in ``data``, through ``MetadataUnpickler``."""
    try:
        metadata = MetadataUnpickler(data, where).load()
    except LingctlError:
        raise
    except Exception as exc:  # truncated or foreign bytes: whatever pickle trips over is a damaged file
        raise VerificationError(
            f"{where}: not a readable DCP metadata file ({type(exc).__name__}: {exc})",
            hint="the checkpoint is damaged; pick another step",
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise VerificationError(
            f"{where}: holds a {type(metadata).__name__}, not DCP checkpoint metadata",
            hint="the checkpoint is damaged; pick another step",
        )
    return metadata


def _check_entry(want: Any, data: bytes, where: str) -> None:
    crc = want.get("crc64nvme") if isinstance(want, dict) else None
    if not crc:
        raise VerificationError(
            f"{where}: {MARKER} records no checksum for it; refusing to load it",
            hint="the marker is not one lingctl wrote",
        )
    if len(data) != want.get("size"):
        raise VerificationError(
            f"{where}: {len(data)} bytes, expected {want.get('size')}; refusing to load it",
            hint="the checkpoint is damaged or was changed after it was saved",
        )
    got = crc64_bytes(data).tagged()
    if got != crc:
        raise VerificationError(
            f"{where}: checksum {got}, expected {crc}; refusing to load it",
            hint="the checkpoint is damaged or was changed after it was saved",
        )


def refusal_reason(exc: BaseException) -> str:
    """The line of a ``torch.load(weights_only=True)`` error that says what was refused, printable and short."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unpickler" in line or "unsupported" in line.lower()]
    reason = (telling or lines or [type(exc).__name__])[0]
    return printable(reason)[:200]


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that never runs code from the checkpoint (see the module docstring).

    ``files`` is the marker's list (name -> size, crc64nvme) of a checkpoint whose other files were already
    verified against it; None reads a checkpoint without a marker (a stock ``dcp.save``), unverified but
    still code-free.
    """

    def __init__(self, path: str | Path, *, files: dict[str, dict] | None = None) -> None:
        super().__init__(path)
        self.files = files
        self._metadata: Metadata | None = None

    def _metadata_path(self) -> Path:
        return Path(self.path) / METADATA

    def read_metadata(self) -> Metadata:
        # No **kwargs on purpose: DCP then never falls back to a rank-local "__N.metadata" this did not check.
        if self._metadata is None:
            path = self._metadata_path()
            if self.files is not None and METADATA not in self.files:
                raise VerificationError(
                    f"{path}: not listed in {MARKER}; refusing to load it", hint="the marker is not one lingctl wrote"
                )
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise os_error(exc, str(path)) from None
            if self.files is not None:
                _check_entry(self.files[METADATA], data, str(path))
            metadata = load_metadata(data, str(path))
            self._check_storage(metadata, str(path))
            self._metadata = metadata
        return self._metadata

    def _check_storage(self, metadata: Metadata, where: str) -> None:
        """Every file the metadata sends DCP to is a plain name in this directory (and listed, with ``files``)."""
        for info in metadata.storage_data.values():
            if not isinstance(info, _StorageInfo) or not all(
                isinstance(v, int) and v >= 0 for v in (info.offset, info.length)
            ):
                raise VerificationError(
                    f"{where}: malformed storage entry {printable(repr(info))[:200]}",
                    hint="the checkpoint is damaged; pick another step",
                )
            name = check_relative(info.relative_path, what=f"{where}: data file")
            if "/" in name or (self.files is not None and name not in self.files):
                raise VerificationError(
                    f"{where}: points at {printable(name)!r}, which {MARKER} does not list; refusing to load it",
                    hint="the checkpoint was tampered with",
                )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _PlainBytes(planner, self))  # type: ignore[arg-type]


class _PlainBytes:
    """Stands in for the load planner while ``SafeReader`` reads: byte items are decoded here with
    ``torch.load(weights_only=True)``, then stored where ``DefaultLoadPlanner.load_bytes`` stores them."""

    def __init__(self, planner: LoadPlanner, reader: SafeReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        planner = self._planner
        if getattr(type(planner), "load_bytes", None) is not DefaultLoadPlanner.load_bytes:
            # Its own load_bytes may unpickle with weights_only=False; only the default storing is known.
            raise LingctlError(
                f"{type(planner).__name__} decodes byte items itself; SafeReader reads them only "
                "for DefaultLoadPlanner and subclasses that keep its load_bytes"
            )
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:
            info = self._reader.storage_data.get(read_item.storage_index)
            where = Path(self._reader.path) / (info.relative_path if info is not None else "?")
            raise VerificationError(
                f"{where}: item {printable(fqn)!r} is not plain data ({refusal_reason(exc)}); refusing to load it",
                hint="the checkpoint was tampered with",
            ) from None
        assert isinstance(planner, DefaultLoadPlanner)
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], obj)
        else:
            planner.state_dict[fqn] = obj
