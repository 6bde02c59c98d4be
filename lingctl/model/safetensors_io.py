"""The safetensors format, written streaming and read through mmap.

The file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}},
plus ``__metadata__``), then the raw little-endian tensor bytes. Writing tensor by tensor keeps memory flat
(the ``safetensors`` package's ``save`` builds the whole file in memory first). Reading maps the file and
wraps each tensor around the mapping, so weights are paged in on use and never held twice; the mapping is
copy-on-write, so callers may modify the tensors without touching the file.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from lingctl.core.errors import LingctlError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Hugging Face loaders refuse files without it ("pt" = written from PyTorch).
DEFAULT_METADATA = {"format": "pt"}


def write_safetensors(f: BinaryIO, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
    header: dict[str, object] = {"__metadata__": dict(metadata or DEFAULT_METADATA)}
    offset = 0
    items: list[tuple[str, torch.Tensor]] = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise LingctlError(f"cannot store tensor {name} of dtype {t.dtype} in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        items.append((name, t))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for _, t in items:
        data = t.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            f.write(memoryview(data.view(torch.uint8).numpy()))


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise LingctlError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise LingctlError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise LingctlError(f"missing weights file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LingctlError(f"{path}: not a safetensors file (bad header)") from None
    return 8 + n, header


def load_safetensors(path: Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of ``path`` (all, or ``names``) as views of a copy-on-write mapping of the file."""
    path = Path(path)
    start, header = read_header(path)
    wanted = set(names) if names is not None else None
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__" or (wanted is not None and name not in wanted):
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            shape = list(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise LingctlError(f"{path}: unsupported or malformed entry for tensor {name}") from None
        if start + end > size:
            raise LingctlError(f"{path}: truncated (tensor {name} ends past the end of the file)")
        count = end - begin
        if count == 0 or mapped is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=count, offset=start + begin)
        out[name] = flat.view(dtype).reshape(shape)
    return out
