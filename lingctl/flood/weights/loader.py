"""Streaming weight loader: a checkpoint far larger than what memory holds twice, loaded in its final form.

The model is built on the ``meta`` device (no memory), with ``Int8Linear`` modules in place of the eligible
linears when quantizing; each tensor is then materialised as the files are read: every shard once, in file
order, through two reused buffers (``StreamReader``), each piece converted straight into the tensor that will
serve (a dtype cast, or int8 rows with their scales), and its pages dropped from the page cache. No full-model
float copy exists at any time, and the checkpoint is never mapped: mapped pages of a 33.6 GB checkpoint on a
machine whose anonymous memory is nearly full are evicted and read again.

Routed experts are allocated per MoE layer as one ``ExpertStack`` (gate and up fused); each expert's
parameters, or ``Int8Linear`` buffers, are views into it, so the stack costs nothing extra.

The results are bit-identical to what mapping the files, casting, ``normalize_head_`` and ``quantize_model_``
gave: the same cast kernels, the same row quantization (``quantize_rows``), and NormHead's column norms in
float32 over the whole vocabulary, computed by column blocks (each column's reduction is the same sequence of
additions whatever the block width, from two columns on; checked by the tests).

Shape legend: V vocabulary, D hidden, E experts, I expert width, X = 2I (gate and up rows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from lingctl.core.errors import LingctlError
from lingctl.flood.engine.experts import ExpertStack, attach_stack
from lingctl.flood.weights.quantize import (
    CHUNK_ROWS,
    INT8_MODES,
    Int8Linear,
    eligible_linears,
    int8_head,
    native_kernels,
    quantize_rows,
)
from lingctl.model.checkpoint import model_state
from lingctl.model.config import LingConfig
from lingctl.model.ling import NORM_HEAD_EPS, LingForCausalLM
from lingctl.model.moe import SparseMoeBlock
from lingctl.model.safetensors_io import Piece, StreamReader, TensorEntry, read_entries, read_into

CHUNK_BYTES = 32 * 2**20  # per read buffer; two buffers, one being filled while the other is converted
F32_BYTES = 2 * CHUNK_BYTES  # float32 rows of one piece being quantized (a piece of 16-bit rows doubles)
NORM_COLUMNS = 64  # NormHead column block: [V, 64] float32 at a time

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale)")
SCALE = "weight_scale"  # a converted checkpoint's per-row scales of NAME.weight (see converted.py)


@dataclass(kw_only=True, slots=True)
class LoadStats:
    files: int
    tensors: int
    bytes_needed: int  # bytes of the tensors this model (or stage) uses
    bytes_read: int  # bytes actually read from the files: equal to bytes_needed when each is read once
    seconds: float


def temp_bytes(config: LingConfig, dtype: torch.dtype, quantize: str | None, *, converted: bool = False) -> int:
    """The loader's peak temporaries: while reading, or, after the last file, baking NormHead (a column
    block, then row chunks in float32 and their rounded copy) and, when int8 keeps a float32 file's head
    until it is baked, that head in float32; with an int8 head (w8a8), the float head until it is quantized.
    A converted checkpoint (``flood quantize``) needs only the read buffers: its bytes are copied into place."""
    if converted:
        return 2 * CHUNK_BYTES
    # two read buffers; quantizing: the float32 rows of a piece, their int8 copy and its transpose
    reading = 2 * CHUNK_BYTES + (F32_BYTES + F32_BYTES // 2 if quantize else 0)
    v, d = config.vocab_size, config.hidden_size
    if not config.norm_head:
        bake = 0
    else:
        bake = v * min(d, NORM_COLUMNS) * 4 + 3 * F32_BYTES // 2
    if config.norm_head and quantize and not _lossless(_file_dtype(config), dtype):
        bake += v * d * _file_dtype(config).itemsize
    if int8_head(quantize, dtype) and not config.tie_word_embeddings:
        # the float head until it is quantized (the int8 one counts as a weight), and one float32 chunk of it
        return max(reading, bake) + v * d * dtype.itemsize + CHUNK_ROWS * d * 4
    return max(reading, bake)


def load_streaming(
    directory: Path,
    config: LingConfig,
    files: dict[str, Path],
    *,
    dtype: torch.dtype,
    quantize: str | None = None,
    layers: tuple[int, int] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    converted: bool = False,
) -> tuple[LingForCausalLM, LoadStats]:
    """The model of ``directory`` (``files``: tensor name -> shard), or with ``layers=(first, last)`` only what
    that pipeline stage needs (the other layers stay on ``meta`` and cost nothing). Every header is checked
    against the config before the first tensor byte is read. ``converted``: the files hold the int8 rows,
    scales and float tensors in their serving form already (``flood quantize``), copied into place as read."""
    if quantize is not None and quantize not in INT8_MODES:
        raise LingctlError(f"unknown quantization {quantize!r}; supported: {', '.join(INT8_MODES)}")
    started = time.monotonic()
    threads = torch.get_num_threads()
    # The conversion is elementwise and memory-bound: one compute thread beside the reading thread keeps
    # both cores busy, and on a busy machine a second compute thread made quantizing 5x slower (measured).
    torch.set_num_threads(1)
    try:
        model, stats = _load(
            directory,
            config,
            files,
            dtype=dtype,
            quantize=quantize,
            layers=layers,
            chunk_bytes=chunk_bytes,
            converted=converted,
        )
    finally:
        torch.set_num_threads(threads)
    stats.seconds = time.monotonic() - started
    return model, stats


def _load(
    directory: Path,
    config: LingConfig,
    files: dict[str, Path],
    *,
    dtype: torch.dtype,
    quantize: str | None,
    layers: tuple[int, int] | None,
    chunk_bytes: int,
    converted: bool = False,
) -> tuple[LingForCausalLM, LoadStats]:
    n = config.num_hidden_layers
    first, last = layers if layers is not None else (0, n)
    with torch.device("meta"):
        # a copy: baking NormHead switches norm_head off on the model's own config
        model = LingForCausalLM(dataclasses.replace(config))
    shapes = {k: tuple(v.shape) for k, v in model_state(model).items()}
    head_int8 = last == n and int8_head(quantize, dtype) and not config.tie_word_embeddings
    int8_weights: set[str] = set()
    if quantize in INT8_MODES:
        int8_weights = _int8_on_meta(model, dtype, act_int8=quantize == "w8a8", head=converted and head_int8)
    names = [k for k in shapes if _wanted(k, config, first, last)]
    if converted:  # each int8 weight's scales beside it
        for name in [k for k in names if k in int8_weights]:
            scale = f"{name.removesuffix('weight')}{SCALE}"
            shapes[scale] = shapes[name][:1]
            names.append(scale)
    missing = [k for k in names if k not in files]
    if missing:
        raise LingctlError(
            f"{directory}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {', '.join(missing[:3])}"
        )
    entries = _entries(files, names, shapes, int8_weights, dtype if converted else None)
    head_name = "model.word_embeddings.weight" if config.tie_word_embeddings else "lm_head.weight"
    bake = last == n and config.norm_head and head_name in entries
    targets = _Targets(model, dtype, quantize, converted=converted)
    for name in names:
        hold = dtype
        if bake and name == head_name and quantize and not _lossless(entries[name].dtype, dtype):
            hold = entries[name].dtype  # normalised at the file's precision first, as quantizing always did
        targets.add(name, entries[name], hold)
    by_file: dict[Path, list[TensorEntry]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(entries[name])
    bytes_read = _read_files(by_file, targets, chunk_bytes)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.word_embeddings.weight
    if bake:
        # int8 normalised the head while it still had the file's dtype; a plain load after the cast
        _bake_head(model, dtype, entries[head_name].dtype if quantize else dtype)
    if head_int8 and not converted:
        _quantize_head(model, dtype)
    model.eval()
    release_free_memory()
    stats = LoadStats(
        files=len(by_file),
        tensors=len(names),
        bytes_needed=sum(e.nbytes for e in entries.values()),
        bytes_read=bytes_read,
        seconds=0.0,
    )
    return model, stats


def _wanted(name: str, config: LingConfig, first: int, last: int) -> bool:
    """Whether the stage holding layers ``[first, last)`` needs tensor ``name``."""
    n = config.num_hidden_layers
    if name.startswith("model.layers."):
        return first <= int(name.split(".")[2]) < last
    if name.startswith("model.word_embeddings."):
        return first == 0 or (last == n and config.tie_word_embeddings)
    return last == n  # model.norm, lm_head


def _read_files(by_file: dict[Path, list[TensorEntry]], targets: _Targets, chunk_bytes: int) -> int:
    """Every file once, in file order, each piece written into its target; the bytes read."""
    bytes_read = 0
    f32 = _Scratch()
    for path in sorted(by_file):
        entries = sorted(by_file[path], key=lambda e: e.begin)
        homes = [(e, targets.home(e)) for e in entries]
        direct = [(e, home) for e, home in homes if home is not None]
        if direct:  # tensors already in their serving form: read straight into place, many per read
            bytes_read += read_into(path, direct, 2 * chunk_bytes)
        reader = StreamReader(path, chunk_bytes)
        piece: Piece | None = None
        for piece in reader.pieces([e for e, home in homes if home is None]):
            e = piece.entry
            src = piece.data.view(e.dtype)
            src = src.reshape((piece.rows, *e.shape[1:])) if e.shape else src.reshape(())
            targets.write(e.name, piece.row, src, f32)
            del src
        bytes_read += reader.bytes_read
        del reader, piece  # its buffers go before the next file's are filled
    f32.release()
    return bytes_read


def _quantize_head(model: LingForCausalLM, dtype: torch.dtype) -> None:
    """w8a8: the (baked) head as int8 with int8 activations, quantized in row chunks; the float head is freed."""
    head = Int8Linear.from_linear(cast(nn.Linear, model.lm_head), dtype)
    head.act_int8 = True
    model.lm_head = cast(nn.Linear, head)


def _bake_head(model: LingForCausalLM, dtype: torch.dtype, round_dtype: torch.dtype) -> None:
    """NormHead folded into the head's weights (rounded to ``round_dtype``), which then take ``dtype``."""
    head = model.lm_head.weight
    _bake_norm_head_(head.data, round_dtype)
    if head.dtype != dtype:
        model.lm_head.weight = nn.Parameter(head.data.to(dtype), requires_grad=False)
        if model.config.tie_word_embeddings:
            model.model.word_embeddings.weight = model.lm_head.weight
    model.config.norm_head = False


# -- building the targets --------------------------------------------------------------------------------


def _int8_on_meta(
    model: LingForCausalLM, dtype: torch.dtype, *, act_int8: bool = False, head: bool = False
) -> set[str]:
    """Int8Linear modules in place of the eligible linears (and the head, with ``head``); their weight names."""
    names = eligible_linears(model, include_head=head)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        q = Int8Linear(lin.in_features, lin.out_features, lin.bias is not None, dtype, device="meta")
        q.act_int8 = act_int8 or (head and name == "lm_head")  # an int8 head always takes int8 activations
        setattr(parent, child, q)
    return {f"{name}.weight" for name in names}


def _entries(
    files: dict[str, Path],
    names: list[str],
    shapes: dict[str, tuple[int, ...]],
    int8_weights: set[str],
    exact_dtype: torch.dtype | None,
) -> dict[str, TensorEntry]:
    """Validated headers of every file involved, each name checked against the shape the config implies; with
    ``exact_dtype`` (a converted checkpoint), the int8 weights int8 and every other tensor in that dtype."""
    found = {path: {e.name: e for e in read_entries(path)} for path in sorted({files[k] for k in names})}
    out: dict[str, TensorEntry] = {}
    for name in names:
        e = found[files[name]].get(name)
        if e is None:
            raise LingctlError(f"{files[name]}: has no tensor {name} (the index says it does)")
        if e.shape != shapes[name]:
            raise LingctlError(f"{files[name]}: tensor {name} has shape {e.shape}, config.json implies {shapes[name]}")
        if exact_dtype is not None:
            want = torch.int8 if name in int8_weights else exact_dtype
            if e.dtype != want:
                raise LingctlError(f"{files[name]}: tensor {name} has dtype {e.dtype}; this conversion needs {want}")
        elif not e.dtype.is_floating_point:
            raise LingctlError(f"{files[name]}: tensor {name} has dtype {e.dtype}; weights must be floating point")
        out[name] = e
    return out


class _Scratch:
    """One float32 buffer reused for every piece that is quantized."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def rows(self, rows: int, width: int) -> torch.Tensor:
        need = rows * width
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(max(need, F32_BYTES // 4), dtype=torch.float32)
        return self._buf[:need].view(rows, width)

    def release(self) -> None:
        self._buf = None


@dataclass(slots=True)
class _Cast:
    dst: torch.Tensor  # final tensor (or a view into an expert stack), rows along dim 0


@dataclass(slots=True)
class _Quant:
    q_OI: torch.Tensor
    scale_O: torch.Tensor


class _Targets:
    """Where each checkpoint tensor goes, allocated in its final form and already installed in the model."""

    def __init__(self, model: LingForCausalLM, dtype: torch.dtype, quantize: str | None, *, converted: bool) -> None:
        self.model = model
        self.converted = converted
        self.dtype = dtype
        self.quantize = quantize
        self.by_name: dict[str, _Cast | _Quant] = {}
        self.stacks: dict[int, ExpertStack] = {}

    def add(self, name: str, entry: TensorEntry, hold: torch.dtype) -> None:
        m = _EXPERT.fullmatch(name)
        if m is not None:
            self.by_name[name] = self._expert(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4) == SCALE)
            return
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        if self.converted and isinstance(module, Int8Linear) and attr in ("weight", SCALE):
            # already int8 rows, or their scales: copied into place
            if attr == "weight":
                module.weight_q = weight_tensor(entry.shape, torch.int8)
                self.by_name[name] = _Cast(module.weight_q)
            else:
                module.scale = torch.empty(entry.shape, dtype=self.dtype)
                self.by_name[name] = _Cast(module.scale)
            return
        if isinstance(module, Int8Linear) and attr == "weight":
            q = weight_tensor(entry.shape, torch.int8)
            scale = torch.empty(entry.shape[0], dtype=self.dtype)
            module.weight_q, module.scale = q, scale
            self.by_name[name] = _Quant(q, scale)
            return
        if name == "lm_head.weight":
            # Input-major ([D, V] storage, the [V, D] parameter a view of it): the engine reads the head
            # row-major and would otherwise copy it into that layout, a second head for a moment.
            t = weight_tensor(tuple(reversed(entry.shape)), hold).t()
        else:
            t = weight_tensor(entry.shape, hold)
        if isinstance(module, Int8Linear):  # its bias is a buffer
            setattr(module, attr, t)
        else:
            setattr(module, attr, nn.Parameter(t, requires_grad=False))
        self.by_name[name] = _Cast(t)

    def _expert(self, layer: int, index: int, proj: str, scale: bool) -> _Cast | _Quant:
        stack = self.stacks.get(layer)
        block = self.model.model.layers[layer].mlp
        assert isinstance(block, SparseMoeBlock)
        if stack is None:
            stack = self._allocate(block)
            self.stacks[layer] = stack
            attach_stack(block, stack)
        width = block.expert(0).down_proj.in_features
        rows = {"gate": slice(0, width), "up": slice(width, 2 * width)}.get(proj)
        w = stack.gate_up_EXD[index, rows] if rows is not None else stack.down_EDI[index]
        s: torch.Tensor | None = None
        if stack.quantized:
            assert stack.gate_up_scale_EX is not None and stack.down_scale_ED is not None
            s = stack.gate_up_scale_EX[index, rows] if rows is not None else stack.down_scale_ED[index]
        module = getattr(block.experts[index], f"{proj}_proj")
        if s is not None:
            module.weight_q, module.scale = w, s
            if self.converted:
                return _Cast(s if scale else w)
            return _Quant(w, s)
        module.weight = nn.Parameter(w, requires_grad=False)
        return _Cast(w)

    def _allocate(self, block: SparseMoeBlock) -> ExpertStack:
        e = len(block.experts)
        width = block.expert(0).down_proj.in_features
        d = block.expert(0).down_proj.out_features
        if self.quantize in INT8_MODES:
            # int8: output-major ([E, 2I, D] and [E, D, I] contiguous), one weight row per output, the layout
            # flood's int8 kernels read; quantized rows are then written in place without a transpose.
            return ExpertStack(
                gate_up_EXD=weight_tensor((e, 2 * width, d), torch.int8),
                down_EDI=weight_tensor((e, d, width), torch.int8),
                gate_up_scale_EX=torch.empty(e, 2 * width, dtype=self.dtype),
                down_scale_ED=torch.empty(e, d, dtype=self.dtype),
            )
        # Float: input-major storage ([E, D, 2I] and [E, I, D] contiguous), seen through transposed views with
        # the stack's [E, 2I, D] / [E, D, I] shapes: the expert products read each weight row-major (x @ W), the
        # layout the forward pass uses without copying.
        gate_up_EXD = weight_tensor((e, d, 2 * width), self.dtype).transpose(1, 2)
        down_EDI = weight_tensor((e, width, d), self.dtype).transpose(1, 2)
        return ExpertStack(gate_up_EXD=gate_up_EXD, down_EDI=down_EDI)

    def home(self, entry: TensorEntry) -> torch.Tensor | None:
        """The bytes of ``entry``'s final tensor when the file's bytes can be read straight into it: a plain
        copy (same dtype) into contiguous memory, as every tensor of a converted checkpoint but the head is."""
        target = self.by_name[entry.name]
        if isinstance(target, _Cast) and target.dst.dim() and target.dst.is_contiguous():
            if target.dst.dtype == entry.dtype:
                return target.dst.view(-1).view(torch.uint8)
        return None

    def write(self, name: str, row: int, src: torch.Tensor, f32: _Scratch) -> None:
        """Rows ``[row, row + len(src))`` of tensor ``name`` from the file's bytes ``src``."""
        target = self.by_name[name]
        if isinstance(target, _Cast):
            if target.dst.dim() == 0:
                target.dst.copy_(src)
            else:
                _copy_rows(target.dst[row : row + src.shape[0]], src)  # the same cast kernel as .to(dtype)
            return
        rows, width = src.shape
        dst = target.q_OI[row : row + rows]
        if src.dtype == torch.bfloat16 and src.is_contiguous() and dst.is_contiguous():
            native = native_kernels()
            # One pass per row in C (8x torch's several passes, measured), the same bits as quantize_rows.
            scale = native.quantize_rows_bf16(src, dst, self.dtype) if native is not None else None
            if scale is not None:
                target.scale_O[row : row + rows].copy_(scale)
                return
        chunk = f32.rows(rows, width)
        scale = quantize_rows(src, self.dtype, chunk)
        if dst.is_contiguous():
            dst.copy_(chunk)  # integral values in [-127, 127]: exact
        else:  # narrow to int8 first: the transpose then moves one byte per element
            # (Transposing on a second thread while the next piece is quantized was measured: no faster on
            # this 2-core machine under its usual load.)
            _copy_rows(dst, chunk.to(torch.int8))
        target.scale_O[row : row + rows].copy_(scale)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; for a transposed (input-major) ``dst``, through a contiguous transpose of ``src``
    in its own dtype: torch's blocked same-dtype transpose, then row-contiguous writes. A direct copy into
    the transposed view writes with a stride per element and took 10x longer (measured, 1408 x 2048)."""
    if dst.dim() == 2 and dst.shape[0] > 1 and dst.stride(0) == 1 and dst.stride(1) != 1:
        if dst.t().is_contiguous() and dst.dtype == src.dtype:
            dst.t().copy_(src.t())  # that blocked transpose straight into place (a whole down_proj)
        else:
            dst.t().copy_(src.t().contiguous())
    else:
        dst.copy_(src)


def _bake_norm_head_(w_VD: torch.Tensor, round_dtype: torch.dtype) -> None:
    """``LingForCausalLM.normalize_head_`` in place on ``w_VD``: each column divided by its L2 norm over the
    vocabulary (float32) + 1e-7, rounded to ``round_dtype``, without a float32 copy of the whole head."""
    v, d = w_VD.shape
    bounds = list(range(0, d, NORM_COLUMNS)) + [d]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]  # a one-column block reduces by another kernel than the whole matrix does
    norm_1D = torch.cat(
        [
            torch.linalg.vector_norm(w_VD[:, a:b].to(torch.float32).contiguous(), ord=2, dim=0, keepdim=True)
            for a, b in zip(bounds, bounds[1:])
        ],
        dim=1,
    )
    norm_1D = norm_1D + NORM_HEAD_EPS
    step = max(1, F32_BYTES // 2 // (4 * d))
    for r0 in range(0, v, step):
        rows = w_VD[r0 : r0 + step]
        rows.copy_((rows.to(torch.float32) / norm_1D).to(round_dtype))


HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14  # Linux


def weight_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor for weights, backed by transparent huge pages where the kernel offers them on request
    (``madvise`` mode, the usual default). Decode streams every weight from memory once per step, and the
    CPU's prefetchers stop at each 4 KiB page boundary: an int8 [126464 x 2048] product read 35.7 GB/s from
    4 KiB pages and 38.6 GB/s from 2 MiB ones (measured, 2 threads). Advice only: nothing changes without it."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes >= 2 * HUGE_PAGE:
        _advise_huge(t.data_ptr(), nbytes)
    return t


def _advise_huge(address: int, nbytes: int) -> None:
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    madvise = _libc_madvise()
    if madvise is not None and end > start:
        madvise(start, end - start, MADV_HUGEPAGE)  # the result does not matter: advice


@functools.cache
def _libc() -> Any:
    """glibc (or None elsewhere): madvise for huge pages, malloc_trim to hand freed memory back."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _libc_madvise() -> Any:
    f = getattr(_libc(), "madvise", None)
    if f is not None:
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
    return f


def release_free_memory() -> None:
    """Hand memory freed by the load (buffers, temporaries) back to the system. glibc keeps freed heap memory
    for reuse, and the fragments left between small tensors that stay stay resident: measured at ~60 MB after
    a 0.5 GB load, which the memory plan would otherwise have to carry for the whole run."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # not glibc: nothing to do
        trim(0)


def _lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly representable in ``dst``."""
    return src == dst or dst == torch.float64 or (dst == torch.float32 and src in (torch.bfloat16, torch.float16))


def _file_dtype(config: LingConfig) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16}.get(config.torch_dtype, torch.bfloat16)
