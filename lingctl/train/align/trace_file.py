"""The trace file of ``lingctl train align``: one safetensors file holding every entry's tensor under its key,
and in its header the entry order and where and how the trace was recorded; and the checks a trace read
back must pass before any of it is used.

A trace is written on one machine (``--save``) and read on another (``--against``): it is data somebody else
may have written, so it is read the way checkpoints are (docs/safety.md): no pickle anywhere (the header is
JSON, the tensors are raw bytes mapped from the file), every declared size and offset checked against the
file before a byte is mapped, and every field the comparison or the report reads checked for its type and
range. A file that fails is refused with exit 4 and one line naming it: it is not what lingctl writes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import UsageError, VerificationError
from lingctl.core.names import printable
from lingctl.model.safetensors_io import DEFAULT_METADATA, load_safetensors, write_safetensors
from lingctl.train.align.setup import check_recorded_setup
from lingctl.train.align.trace import FORCED, LOSS, PROBS, ROOT, ROUTES, TRACE_FORMAT, Entry, Trace

META_KEY = "lingctl.align"
MAX_HEADER_BYTES = 100 * 2**20  # as the checkpoint reader's limit: a header is names and shapes, never data
MAX_NAME_CHARS = 512
# Bytes per element of each safetensors dtype the reader maps (``lingctl.model.safetensors_io``).
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# Module names are the model's dotted attribute paths; entries are ``out``, ``out.logits``, ``grad_in.0``,
# ``grad.weight``, a loss part, with ``#N`` for a module's N-th call. Nothing else is ever recorded, and
# these names are shown on the terminal, so anything else (``..``, '/', control characters) is refused.
_DOTTED = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_ENTRY = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*(?:#[0-9]+)?")
_STRINGS = ("weights", "torch", "host", "device_name")
_OBJECTS = ("model", "loss")


def save_trace(path: Path, trace: Trace) -> None:
    """Write ``trace`` as one safetensors file: tensors keyed by entry key, the entry order and ``meta`` as
    JSON in the header. Atomic: a crash leaves the previous file or none, never a part."""
    tensors: dict[str, torch.Tensor] = {}
    order = []
    for e in trace.entries:
        assert e.tensor is not None
        tensors[e.key] = e.tensor.contiguous()
        order.append([e.phase, e.module, e.what])
    meta = {**DEFAULT_METADATA, META_KEY: json.dumps({"format": TRACE_FORMAT, **trace.meta, "entries": order})}
    with atomic_write(path) as (_, f):
        write_safetensors(f, tensors, meta)


class _Refused(Exception):
    """Why a trace file is not one lingctl wrote (turned into one VerificationError naming the file)."""


def load_trace(path: Path) -> Trace:
    """Read a trace written by ``save_trace``, checking all of it first; ``VerificationError`` (exit 4) naming
    the file when any part is not what ``save_trace`` writes. Nothing is unpickled or run."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no trace file at {path}")
    try:
        header, size = _header(path)
        meta = _meta(header)
        listed = _entries(meta.pop("entries"))
        _tensor_table(header, size, {e.key for e in listed})
        tensors = load_safetensors(path, names=[e.key for e in listed])
        for e in listed:
            e.tensor = tensors[e.key]
        _check_routes(listed, meta["model"])
    except _Refused as why:
        raise VerificationError(
            f"{path} is not a trace of lingctl train align: {why}",
            hint="record it again with lingctl train align --save",
        ) from None
    except OSError as exc:
        raise VerificationError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    meta.pop("format")
    return Trace(entries=listed, meta=meta)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header as a JSON object, and the size of the data after it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise _Refused("too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _Refused(f"its header claims {n} bytes, the file has {size}")
        raw = f.read(n)
    try:
        # ValueError: bad JSON, text that is not UTF-8, or an integer too long to read; RecursionError: nesting.
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise _Refused("its header is not JSON (a safetensors file starts with one)") from None
    if not isinstance(header, dict):
        raise _Refused("its header is not a JSON object")
    return header, size - 8 - n


def _meta(header: dict[str, Any]) -> dict[str, Any]:
    metadata = header.get("__metadata__")
    raw = metadata.get(META_KEY) if isinstance(metadata, dict) else None
    if not isinstance(raw, str):
        raise _Refused(f"no {META_KEY} record in its metadata")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        raise _Refused(f"its {META_KEY} record is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != TRACE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise _Refused(f"format {_shown(found)}, expected {TRACE_FORMAT!r}")
    why = check_recorded_setup(meta.get("setup"))
    if why is not None:
        raise _Refused(f"set-up: {why}")
    batch = meta.get("batch")
    if not isinstance(batch, dict) or not all(_count(batch.get(k)) for k in ("batch_size", "seq_len")):
        raise _Refused("batch: expected batch_size and seq_len as whole numbers >= 1")
    if not isinstance(batch.get("seed"), int) or isinstance(batch.get("seed"), bool):
        raise _Refused("batch: expected a whole-number seed")
    for key in _OBJECTS:
        if not isinstance(meta.get(key), dict):
            raise _Refused(f"{key}: expected an object")
    for key in _STRINGS:
        if not _text(meta.get(key)):
            raise _Refused(f"{key}: expected text without control characters")
    if meta.get("modules") is not None and not _text(meta["modules"]):
        raise _Refused("modules: expected a regular expression or null")
    if not isinstance(meta.get(FORCED, False), bool):
        raise _Refused(f"{FORCED}: expected true or false")
    if not isinstance(meta.get("entries"), list):
        raise _Refused("entries: expected a list")
    return meta


def _entries(order: list[Any]) -> list[Entry]:
    entries: list[Entry] = []
    seen: set[str] = set()
    for i, item in enumerate(order):
        if not (isinstance(item, list) and len(item) == 3 and all(isinstance(x, str) for x in item)):
            raise _Refused(f"entry {i}: expected [phase, module, entry], got {_shown(item)}")
        phase, module, what = item
        if phase not in ("fwd", "bwd"):
            raise _Refused(f"entry {i}: phase {_shown(phase)} is not fwd or bwd")
        if module not in (ROOT, LOSS) and not _name(_DOTTED, module):
            raise _Refused(f"entry {i}: {_shown(module)} is not a module name")
        if not _name(_ENTRY, what):
            raise _Refused(f"entry {i}: {_shown(what)} is not an entry name")
        e = Entry(phase=phase, module=module, what=what)
        if e.key in seen:
            raise _Refused(f"entry {i}: {_shown(e.key)} is listed twice")
        seen.add(e.key)
        entries.append(e)
    return entries


def _tensor_table(header: dict[str, Any], size: int, wanted: set[str]) -> None:
    """Every listed tensor is in the header, with a known dtype, a shape of whole numbers and a byte range
    inside the file that holds exactly that many elements (checked before anything is mapped or allocated)."""
    for key in sorted(wanted):
        info = header.get(key)
        if not isinstance(info, dict):
            raise _Refused(f"it lists {_shown(key)} but holds no such tensor")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ITEM_BYTES:
            raise _Refused(f"tensor {_shown(key)}: dtype {_shown(dtype)} is not one lingctl writes")
        if not isinstance(shape, list) or not all(_count(d, least=0) for d in shape):
            raise _Refused(f"tensor {_shown(key)}: shape {_shown(shape)} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o, least=0) for o in offsets)):
            raise _Refused(f"tensor {_shown(key)}: data_offsets {_shown(offsets)} are not two byte positions")
        begin, end = offsets
        if not begin <= end <= size:
            raise _Refused(f"tensor {_shown(key)}: bytes {begin}..{end} lie outside the {size} bytes of data")
        if math.prod(shape) * _ITEM_BYTES[dtype] != end - begin:
            raise _Refused(f"tensor {_shown(key)}: shape {shape} of {dtype} does not fill bytes {begin}..{end}")


def _check_routes(entries: list[Entry], model: dict[str, Any]) -> None:
    """The routers' entries index tensors (expert ids into probabilities): ids must be integers in range,
    one row of k per token, and the probabilities one row of E per token, or the comparison would index
    out of bounds."""
    experts = model["num_experts"] if _count(model.get("num_experts")) else 0
    k = model["num_experts_per_tok"] if _count(model.get("num_experts_per_tok")) else 0
    by_key = {e.key: e for e in entries}
    for e in entries:
        t = e.tensor
        assert t is not None
        base = e.what.split("#")[0]
        if e.phase != "fwd" or base not in (ROUTES, PROBS):
            continue
        if not (experts and k):
            raise _Refused(f"{_shown(e.key)}: the model has no num_experts and num_experts_per_tok to check it")
        if base == ROUTES:
            if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != k:
                raise _Refused(f"{_shown(e.key)}: expected int64 expert ids of shape (tokens, {k})")
            if t.numel() and not (int(t.min()) >= 0 and int(t.max()) < experts):
                raise _Refused(f"{_shown(e.key)}: expert ids outside 0..{experts - 1}")
            probs = by_key.get(f"fwd:{e.module}:{PROBS}")
            if probs is not None and probs.tensor is not None and probs.tensor.shape[:1] != t.shape[:1]:
                raise _Refused(f"{_shown(probs.key)}: {probs.tensor.shape[0]} tokens, the routes have {t.shape[0]}")
        elif not t.dtype.is_floating_point or t.dim() != 2 or t.shape[1] != experts:
            raise _Refused(f"{_shown(e.key)}: expected probabilities of shape (tokens, {experts})")


def _count(value: Any, *, least: int = 1) -> bool:
    """A whole number (not a bool, which JSON reads as one) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _text(value: Any) -> bool:
    return isinstance(value, str) and printable(value) == value


def _name(pattern: re.Pattern[str], value: str) -> bool:
    return len(value) <= MAX_NAME_CHARS and pattern.fullmatch(value) is not None


def _shown(value: Any) -> str:
    """A value from the file, for one line of an error: control characters escaped, cut short."""
    text = printable(value if isinstance(value, str) else json.dumps(value, default=str))
    return repr(text[:80] + ("..." if len(text) > 80 else ""))
