"""flood's int8 serving form on disk: ``lingctl flood quantize SRC DST`` converts a checkpoint once, and every
later ``flood run``/``flood eval`` of DST loads it by plain sequential reads, without converting anything.

Why a directory the user names rather than a cache lingctl fills on its own: the converted form of Ling-lite is
17 GB, a cost a user should see and place (a fast local disk, the node-local scratch of a cluster job) and can
copy to other machines, as llama.cpp users keep their GGUF files; and lingctl never writes inside the user's
checkpoint. The form is tied to what it was made for: ``--quantize`` (int8 or w8a8) and ``--dtype`` (the dtype of
the scales and of every float tensor); a run asking for something else is refused in one line.

Layout: a Hugging Face style directory (``config.json``, safetensors shards of at most ``SHARD_BYTES`` with
``model.safetensors.index.json``, and the source's tokenizer, chat template and generation config). Each int8
linear is stored as ``NAME.weight`` (int8, one row per output) and ``NAME.weight_scale`` (one scale per row),
the tensors flood serves, bit for bit; NormHead is already folded into the head (``norm_head`` is false in
config.json) and ``quantization_config`` says what the form is. transformers cannot load it; it is flood's.

An interrupted conversion leaves DST with a marker file: the next run of the same command redoes it in place
(it is one load and one write). Only a new or empty directory gets a marker, so everything beside it is
lingctl's own.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lingctl.core.atomic import atomic_write, fsync_dir
from lingctl.core.errors import LingctlError, UsageError, os_error
from lingctl.model.checkpoint_files import (
    CHAT_TEMPLATE,
    CONFIG,
    GENERATION_CONFIG,
    SPECIAL_TOKENS_MAP,
    TOKENIZER,
    TOKENIZER_CONFIG,
    WEIGHTS_INDEX,
)
from lingctl.model.config import LingConfig
from lingctl.model.hf_files import index_json, plan_shards, shard_names, tensor_bytes
from lingctl.model.safetensors_io import write_safetensors

QUANT_METHOD = "lingctl-int8"
SCALE_SUFFIX = ".weight_scale"
MARKER = ".lingctl-quantize-incomplete"  # present while a conversion into the directory is unfinished
SHARD_BYTES = 4 * 2**30
SIDE_FILES = (TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE, GENERATION_CONFIG)


@dataclass(frozen=True, slots=True)
class ConvertedForm:
    """What a converted directory holds: ``mode`` (int8 or w8a8) for ``dtype`` activations, made from the
    checkpoint whose fingerprint is ``source``."""

    mode: str
    dtype: str
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "mode": self.mode, "dtype": self.dtype, "source_fingerprint": self.source}

    @staticmethod
    def of_directory(path: Path) -> ConvertedForm | None:
        """The form ``path/config.json`` declares, or None for an ordinary checkpoint."""
        try:
            data = json.loads((Path(path) / CONFIG).read_text())
        except (OSError, ValueError):
            return None  # the config is read and reported properly elsewhere
        q = data.get("quantization_config") if isinstance(data, dict) else None
        if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
            return None
        mode, dtype, source = q.get("mode"), q.get("dtype"), q.get("source_fingerprint", "")
        if mode not in ("int8", "w8a8") or dtype not in ("float32", "bfloat16", "float16"):
            raise LingctlError(f"{path / CONFIG}: quantization_config names mode {mode!r}, dtype {dtype!r}")
        return ConvertedForm(mode=mode, dtype=dtype, source=str(source))

    def serving_quantize(self, quantize: str | None, dtype: str, where: Path) -> str:
        """The ``--quantize`` a run of this directory uses; a UsageError when the run asks for another."""
        if quantize not in (None, self.mode) or dtype != self.dtype:
            raise UsageError(
                f"{where} was converted for --quantize {self.mode} --dtype {self.dtype}; "
                f"this run asks for --quantize {quantize or 'none'} --dtype {dtype}",
                hint=f"run with --quantize {self.mode} --dtype {self.dtype}, or convert the original checkpoint again",
            )
        return self.mode


class ModelSource(Protocol):
    """What a conversion reads from its source (a ``ModelDir``, which imports this module)."""

    path: Path
    config: LingConfig
    converted: ConvertedForm | None

    def fingerprint(self) -> str: ...

    def load_with_stats(self, *, dtype: torch.dtype, quantize: str | None = None) -> tuple[nn.Module, Any]: ...


@dataclass(kw_only=True, slots=True)
class ConvertReport:
    source: str
    out: str
    mode: str
    dtype: str
    files: int
    tensors: int
    bytes_written: int
    load_seconds: float
    write_seconds: float
    reused: bool = False  # DST already held this conversion: nothing done


def check_destination(dst: Path, form: ConvertedForm) -> bool:
    """True when ``dst`` already holds exactly this conversion (nothing to do). A UsageError when it holds
    anything lingctl did not start writing there; an unfinished conversion (the marker) may be redone."""
    if not dst.exists():
        return False
    if not dst.is_dir():
        raise UsageError(f"{dst} exists and is not a directory", hint="name a new directory")
    if (dst / MARKER).exists():
        return False
    existing = ConvertedForm.of_directory(dst)
    if existing == form:
        return True
    if any(dst.iterdir()):
        raise UsageError(
            f"{dst} is not empty; lingctl writes a conversion only into a new or empty directory",
            hint="name a new directory",
        )
    return False


def serving_tensors(model: nn.Module, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a loaded model serves, under their checkpoint names (``names``: the float model's), each
    ``Int8Linear`` as its int8 rows and their scales. A tensor held twice (a tied head) is written once."""
    from lingctl.flood.weights.quantize import Int8Linear

    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, Int8Linear):
            own = [("weight", module.weight_q), ("weight_scale", module.scale), ("bias", module.bias)]
        else:
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for attr, t in own:
            name = f"{prefix}{attr}"
            if t is None or id(t) in seen or not (isinstance(module, Int8Linear) or name in names):
                continue
            seen.add(id(t))
            yield name, t


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """One safetensors file; the bytes written. Its pages are dropped from the page cache once on disk: a 17 GB
    conversion should not evict everything else."""
    with atomic_write(path) as (_, f):
        written = write_safetensors(f, tensors)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return written


def converted_config(config: LingConfig, form: ConvertedForm) -> dict[str, Any]:
    data = config.to_hf_dict()
    data["norm_head"] = False  # folded into the head's rows
    data["torch_dtype"] = form.dtype
    data["quantization_config"] = form.to_json()
    return data


def convert(
    src: ModelSource,
    dst: Path,
    *,
    mode: str,
    dtype: str,
    on_phase: Callable[[str], None] | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> ConvertReport:
    """Convert the checkpoint of ``src`` into ``dst``: load it as ``flood run --quantize MODE --dtype DTYPE``
    would, then write what was loaded. Peak memory is that of serving the model."""
    from lingctl.flood.engine.plan import check_weights_fit
    from lingctl.model.checkpoint import parse_dtype

    if src.converted is not None:
        raise UsageError(f"{src.path} is already a converted checkpoint", hint="convert the original checkpoint")
    form = ConvertedForm(mode=mode, dtype=dtype, source=src.fingerprint())
    report = ConvertReport(
        source=str(src.path), out=str(dst), mode=mode, dtype=dtype, files=0, tensors=0, bytes_written=0,
        load_seconds=0.0, write_seconds=0.0,
    )  # fmt: skip
    if check_destination(dst, form):
        report.reused = True
        return report
    check_weights_fit(src.config, dtype=parse_dtype(dtype), quantize=mode)  # before anything is written
    try:
        dst.mkdir(parents=True, exist_ok=True)
        (dst / MARKER).write_text(json.dumps({"source": str(src.path), "mode": mode, "dtype": dtype}) + "\n")
        fsync_dir(dst)
        if on_phase is not None:
            on_phase(f"loading {src.path} ({mode}, {dtype})")
        model, stats = src.load_with_stats(dtype=parse_dtype(dtype), quantize=mode)
        report.load_seconds = stats.seconds
        started = time.monotonic()
        _write(model, src, dst, form, report, on_phase, shard_bytes)
        report.write_seconds = time.monotonic() - started
    except OSError as exc:  # a full disk, a directory that cannot be created: one line; the marker stays
        raise os_error(exc, str(dst)) from None
    return report


def _write(
    model: nn.Module,
    src: ModelSource,
    dst: Path,
    form: ConvertedForm,
    report: ConvertReport,
    on_phase: Callable[[str], None] | None,
    shard_bytes: int,
) -> None:
    """The loaded ``model`` into ``dst``: shards, index, side files, then config.json; the marker goes last."""
    from lingctl.model.checkpoint import model_state
    from lingctl.model.ling import LingForCausalLM

    with torch.device("meta"):
        names = set(model_state(LingForCausalLM(src.config)))
    tensors = dict(serving_tensors(model, names))
    shards = plan_shards(((name, tensor_bytes(t)) for name, t in tensors.items()), shard_bytes)
    files = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards):
        if on_phase is not None:
            on_phase(f"writing {file} ({len(shard)} tensors)")
        report.bytes_written += write_shard(dst / file, {name: tensors[name] for name in shard})
        weight_map.update({name: file for name in shard})
    with atomic_write(dst / WEIGHTS_INDEX) as (_, f):
        f.write((json.dumps(index_json(weight_map, report.bytes_written), indent=2) + "\n").encode())
    for side in SIDE_FILES:
        if (src.path / side).is_file():
            with atomic_write(dst / side) as (_, f), open(src.path / side, "rb") as g:
                shutil.copyfileobj(g, f)
    with atomic_write(dst / CONFIG) as (_, f):  # last: with the marker gone, it says the conversion is whole
        f.write((json.dumps(converted_config(src.config, form), indent=2) + "\n").encode())
    (dst / MARKER).unlink()
    fsync_dir(dst)
    report.files, report.tensors = len(shards), len(tensors)
