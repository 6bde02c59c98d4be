"""The safetensors format, written streaming, read through mmap or streamed with pread.

The file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}},
plus ``__metadata__``), then the raw little-endian tensor bytes. Writing tensor by tensor keeps memory flat
(the ``safetensors`` package's ``save`` builds the whole file in memory first). Reading maps the file and
wraps each tensor around the mapping, so weights are paged in on use and never held twice; the mapping is
copy-on-write, so callers may modify the tensors without touching the file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from lingctl.core.errors import LingctlError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Hugging Face loaders refuse files without it ("pt" = written from PyTorch).
DEFAULT_METADATA = {"format": "pt"}


WRITE_PIECE_BYTES = 64 * 2**20  # a non-contiguous tensor is written in row pieces of about this size


def write_safetensors(
    f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` (by name) to ``f``; the bytes written. A non-contiguous tensor (a transposed view) goes
    out in row pieces, never as one contiguous copy of the whole tensor."""
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
        for piece in _pieces(t.detach().to("cpu")):
            f.write(piece.view(torch.uint8).numpy().data)
    return 8 + len(raw) + offset


def _pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
    if not t.numel():
        return
    if t.is_contiguous() or t.dim() == 0:
        yield t.contiguous().reshape(-1)
        return
    rows = max(1, WRITE_PIECE_BYTES // max(1, t[0].numel() * t.element_size()))
    for r0 in range(0, t.shape[0], rows):
        yield t[r0 : r0 + rows].contiguous().reshape(-1)


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


# -- streaming reads --------------------------------------------------------------------------------------
#
# For checkpoints larger than what memory can hold twice: a mapping's pages count against the page cache of a
# machine whose anonymous memory is nearly full, get evicted and are read again (a 33.6 GB checkpoint read
# 80+ GB this way). Reading with pread into a small reused buffer reads each byte once, in file order, and the
# ranges already used are dropped from the page cache at once.


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file, validated: ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (index along dim 0); a 0-d or 1-d tensor's row is one element."""
        inner = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        return inner * self.dtype.itemsize


def read_entries(path: Path) -> list[TensorEntry]:
    """Every tensor of ``path`` in file order, after checking what a reader relies on: known dtypes,
    non-negative integer shapes, offsets that match the shape's size, lie inside the file and do not
    overlap. A truncated or inconsistent file fails here with one line, before any tensor byte is read."""
    path = Path(path)
    start, header = read_header(path)
    size = path.stat().st_size
    entries: list[TensorEntry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(info["shape"])
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise LingctlError(f"{path}: unsupported or malformed entry for tensor {name}") from None
        if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise LingctlError(
                f"{path}: tensor {name} has offsets [{begin}, {end}] that do not match its shape "
                f"{list(shape)} of {info['dtype']}"
            )
        if start + end > size:
            raise LingctlError(f"{path}: truncated (tensor {name} ends at byte {start + end}, the file has {size})")
        entries.append(TensorEntry(name=name, dtype=dtype, shape=shape, begin=start + begin, end=start + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    for a, b in zip(entries, entries[1:]):
        if b.begin < a.end:
            raise LingctlError(f"{path}: tensors {a.name} and {b.name} overlap")
    return entries


@dataclass(slots=True)
class Piece:
    """Rows ``[row, row + rows)`` of ``entry``, as raw bytes in a reused buffer: valid until the next piece
    is asked for."""

    entry: TensorEntry
    row: int
    rows: int
    data: torch.Tensor  # uint8, rows * entry.row_bytes


class StreamReader:
    """Reads chosen tensors of one file in file order, each byte once, into two reused buffers of
    ``chunk_bytes``: one is filled by a background thread (pread releases the GIL) while the caller converts
    the other. A tensor larger than a buffer comes in pieces of whole rows. Each range is dropped from the
    page cache (POSIX_FADV_DONTNEED) once the caller is done with it."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(2)]

    def pieces(self, entries: Iterable[TensorEntry]) -> Iterator[Piece]:
        """``entries`` (from ``read_entries``, in file order) piece by piece. Pieces that follow each other in
        the file are read together, up to a buffer at a time: a checkpoint of thousands of few-MB tensors (one
        per expert) read one tensor per call left the disk idle between calls (the load took 1.9x a cold read
        of the files; measured on Ling-lite)."""
        segments: list[_Segment] = []
        for e in entries:
            per = max(1, self.chunk_bytes // e.row_bytes) if e.row_bytes else 1
            n = e.shape[0] if len(e.shape) >= 1 else 1
            n = max(n, 1) if e.nbytes else 0
            for r in range(0, n, per):
                segments.append(_Segment(e, r, min(per, n - r)))
        reads: list[list[_Segment]] = []
        size = end = 0
        for seg in segments:
            # (a piece starts at a multiple of its element size within the buffer, so it can be viewed as its dtype)
            aligned = size % seg.entry.dtype.itemsize == 0
            if reads and seg.offset == end and aligned and size + seg.nbytes <= self.chunk_bytes:
                reads[-1].append(seg)
                size += seg.nbytes
            else:
                reads.append([seg])
                size = seg.nbytes
            end = seg.offset + seg.nbytes
        if not reads:
            return
        fd = os.open(self.path, os.O_RDONLY)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safetensors-read")
        try:
            _advise(fd, os.POSIX_FADV_SEQUENTIAL if hasattr(os, "POSIX_FADV_SEQUENTIAL") else None)
            pending = pool.submit(self._read, fd, reads[0], 0)
            for i, read in enumerate(reads):
                data = pending.result()
                if i + 1 < len(reads):
                    pending = pool.submit(self._read, fd, reads[i + 1], (i + 1) % 2)
                at = 0
                for seg in read:
                    yield Piece(entry=seg.entry, row=seg.row, rows=seg.rows, data=data[at : at + seg.nbytes])
                    at += seg.nbytes
                # The caller has converted these pieces: their pages are of no further use.
                _advise(fd, getattr(os, "POSIX_FADV_DONTNEED", None), read[0].offset, at)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(fd)

    def _read(self, fd: int, read: list[_Segment], slot: int) -> torch.Tensor:
        n = sum(seg.nbytes for seg in read)
        if n > self._buffers[slot].numel():  # one row wider than the buffer: grow this one
            self._buffers[slot] = torch.empty(n, dtype=torch.uint8)
        out = self._buffers[slot][:n]
        _preadv_all(fd, self.path, [out.numpy().data.cast("B")], read[0].offset, n, f"tensor {read[0].entry.name}")
        self.bytes_read += n
        return out


@dataclass(slots=True)
class _Segment:
    """Rows ``[row, row + rows)`` of ``entry``: one piece."""

    entry: TensorEntry
    row: int
    rows: int

    @property
    def offset(self) -> int:
        return self.entry.begin + self.row * self.entry.row_bytes

    @property
    def nbytes(self) -> int:
        return self.rows * self.entry.row_bytes


def read_into(path: Path, items: list[tuple[TensorEntry, torch.Tensor]], batch_bytes: int = 64 * 2**20) -> int:
    """Read each entry's bytes straight into its tensor (contiguous uint8 of ``entry.nbytes``), in file order,
    entries that follow each other in the file gathered into one ``preadv`` of up to ``batch_bytes`` (a
    converted checkpoint holds thousands of few-MB tensors: one read each left the disk idle between them).
    Ranges are dropped from the page cache once read. Returns the bytes read."""
    items = sorted(items, key=lambda it: it[0].begin)
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        _advise(fd, getattr(os, "POSIX_FADV_SEQUENTIAL", None))
        i = 0
        while i < len(items):
            start = items[i][0].begin
            end = start
            views: list[memoryview] = []
            while i < len(items) and items[i][0].begin == end and (not views or end - start < batch_bytes):
                entry, home = items[i]
                if entry.nbytes:
                    views.append(home.numpy().data.cast("B"))
                end += entry.nbytes
                i += 1
            total += _preadv_all(fd, path, views, start, end - start, f"tensor {items[i - 1][0].name}")
            _advise(fd, getattr(os, "POSIX_FADV_DONTNEED", None), start, end - start)
    finally:
        os.close(fd)
    return total


def _preadv_all(fd: int, path: Path, views: list[memoryview], offset: int, n: int, what: str) -> int:
    """``n`` bytes from ``offset`` into ``views``, through short reads; a LingctlError naming ``what`` at EOF."""
    done = 0
    while done < n:
        got = os.preadv(fd, _skip(views, done), offset + done)
        if got <= 0:
            raise LingctlError(f"{path}: truncated while reading {what} (the file changed while it was read?)")
        done += got
    return done


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes (after a short read)."""
    out: list[memoryview] = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _advise(fd: int, advice: int | None, offset: int = 0, length: int = 0) -> None:
    if advice is None or not hasattr(os, "posix_fadvise"):
        return
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError:  # advice only: some filesystems refuse it
        pass
