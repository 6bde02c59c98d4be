"""A model's tensors (names, shapes, dtypes, in state-dict order) and its numbers of layers, routed experts
and attention heads, read without loading any weights.

Three sources are read:

- a preset name (``lingctl.model.presets``): the Ling model is built on the meta device, one dense and one
  MoE layer as templates for the rest, with parameter initialisation skipped;
- a checkpoint directory (``config.json`` and safetensors files, sharded or not): only the safetensors
  headers are read; a Ling (``bailing_moe``) config puts the tensors in the model's own order, any other
  in natural name order. A Hugging Face model id (``org/name[@rev]``) that is not a local path names its
  snapshot directory in the Hugging Face cache (``lingctl.model.hub``);
- a JSON file listing ``[{"name", "shape", "dtype"}]``, in the order given.

Where the source gives no config, layers and experts are counted from the tensor names and the number of
heads is left unknown.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, UsageError
from lingctl.model.checkpoint_files import CONFIG

DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
# safetensors header names -> the torch names used here.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(kw_only=True, slots=True, frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(kw_only=True, slots=True)
class Model:
    source: str  # the preset name, directory or tensor list it came from
    tensors: list[Tensor]
    num_layers: int
    num_experts: int  # 0 for a dense model
    num_heads: int | None  # None when the source does not say (a bare tensor list)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)


def load_model(source: str) -> Model:
    """A preset name, a checkpoint directory (config.json + safetensors; only headers are read) or a Hugging
    Face model id naming one in the cache, or a JSON file listing ``[{"name", "shape", "dtype"}]``."""
    from lingctl.model.hub import is_repo_id, resolve_model_dir
    from lingctl.model.presets import PRESETS, preset

    if source in PRESETS:
        config = preset(source)
        return Model(
            source=source,
            tensors=ling_tensors(config),
            num_layers=config.num_hidden_layers,
            num_experts=config.num_experts,
            num_heads=config.num_attention_heads,
        )
    path = Path(source).expanduser()
    if path.is_dir():
        return _directory_model(path)
    if path.is_file() and path.suffix == ".json":
        return _listed_model(path)
    if path.exists():
        raise UsageError(f"--model {source}: expected a checkpoint directory or a .json tensor list")
    if is_repo_id(source) and path.suffix != ".json":  # a missing tensor list is not looked up on the Hub
        return dataclasses.replace(_directory_model(resolve_model_dir(source, option="--model")), source=source)
    if "/" in source or path.suffix:
        raise UsageError(f"--model {source}: no such directory or file")
    raise UsageError(
        f"unknown model preset {source!r}",
        hint=f"choose one of {', '.join(PRESETS)}, or give a checkpoint directory, a Hugging Face "
        f"model id ORG/NAME or a tensors .json",
    )


def ling_tensors(config: Any, dtype: str | None = None) -> list[Tensor]:
    """The parameters of a Ling model in ``named_parameters()`` order, read off the model code on the meta
    device. Only one dense and one MoE layer are built (a full Ling-plus takes seconds); the other layers
    repeat their template's names and shapes."""
    import torch

    from lingctl.model.ling import LingForCausalLM

    layers, dense = config.num_hidden_layers, config.first_k_dense_replace
    kinds = ([0] if dense > 0 else []) + ([1] if dense < layers else [])
    template = dataclasses.replace(config, num_hidden_layers=len(kinds), first_k_dense_replace=1 if dense else 0)
    with torch.device("meta"), _skip_init_mode():
        model = LingForCausalLM(template)
    dtype = dtype or config.torch_dtype
    before: list[Tensor] = []
    after: list[Tensor] = []
    per_template: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in kinds]
    prefix = "model.layers."
    for name, p in model.named_parameters():
        if name.startswith(prefix):
            index, rest = name[len(prefix) :].split(".", 1)
            per_template[int(index)].append((rest, tuple(p.shape)))
        else:
            (after if any(per_template) else before).append(Tensor(name=name, shape=tuple(p.shape), dtype=dtype))
    out = list(before)
    for i in range(layers):
        t = 0 if i < dense else len(kinds) - 1
        out.extend(Tensor(name=f"{prefix}{i}.{rest}", shape=shape, dtype=dtype) for rest, shape in per_template[t])
    out.extend(after)
    return out


def _skip_init_mode() -> Any:
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        """Parameter initialisation as a no-op. Only names and shapes are read, and on the meta device
        ``nn.init.normal_`` runs through a decomposition whose first use imports torch's compiler stack
        (1-2 s here)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") in _INIT_FUNCTIONS and (args or "tensor" in kwargs):
                return args[0] if args else kwargs["tensor"]
            return func(*args, **kwargs)

    return SkipInit()


_INIT_FUNCTIONS = frozenset(
    {"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_", "fill_", "zero_"}
)


def _directory_model(path: Path) -> Model:
    from lingctl.model.checkpoint import weight_files
    from lingctl.model.safetensors_io import read_header

    config: dict[str, Any] = {}
    config_path = path / CONFIG
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{config_path}: not valid JSON ({exc})") from None
    try:
        files = weight_files(path)
        headers = {f: read_header(f)[1] for f in sorted(set(files.values()))}
    except LingctlError as exc:
        raise UsageError(f"--model {path}: {exc.message}") from None
    tensors = []
    for name, file in files.items():
        entry = headers[file].get(name)
        if entry is None:
            raise UsageError(f"{file}: the index lists {name}, but the file's header does not hold it")
        raw_dtype = entry.get("dtype")
        dtype = _SAFETENSORS_DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
        if dtype is None:
            raise UsageError(f"{file}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
        tensors.append(Tensor(name=name, shape=tuple(int(d) for d in entry["shape"]), dtype=dtype))
    # State-dict order, as a training job would hold it: the model's own for a Ling config, else by name.
    rank: dict[str, int] = {}
    if config.get("model_type") == "bailing_moe":
        from lingctl.model.config import LingConfig

        try:
            rank = {t.name: i for i, t in enumerate(ling_tensors(LingConfig.from_hf_dict(config)))}
        except LingctlError as exc:
            raise UsageError(f"{config_path}: {exc.message}") from None
    tensors.sort(key=lambda t: (rank.get(t.name, len(rank)), _natural(t.name)))
    layers, experts = _counts(tensors)
    experts = next((int(config[k]) for k in _EXPERT_KEYS if config.get(k)), experts)
    heads = config.get("num_attention_heads")
    return Model(
        source=str(path),
        tensors=tensors,
        num_layers=int(config.get("num_hidden_layers") or layers),
        num_experts=experts,
        num_heads=int(heads) if heads else None,
    )


def _listed_model(path: Path) -> Model:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f'{path}: expected a non-empty list of {{"name", "shape", "dtype"}} objects')
    tensors = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise UsageError(f'{path}: entry {i} needs a "name" string')
        name, shape = entry["name"], entry.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise UsageError(f"{path}: {name}: shape must be a list of non-negative integers, got {shape!r}")
        dtype = dtype_name(entry.get("dtype", "bfloat16"), f"{path}: {name}")
        if name in seen:
            raise UsageError(f"{path}: tensor {name} is listed twice")
        seen.add(name)
        tensors.append(Tensor(name=name, shape=tuple(shape), dtype=dtype))
    layers, experts = _counts(tensors)
    return Model(source=str(path), tensors=tensors, num_layers=layers, num_experts=experts, num_heads=None)


def dtype_name(value: Any, where: str) -> str:
    name = _SAFETENSORS_DTYPES.get(value, value) if isinstance(value, str) else value
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise UsageError(f"{where}: unknown dtype {value!r}", hint=f"use one of {', '.join(DTYPE_SIZES)}")
    return name


def _counts(tensors: list[Tensor]) -> tuple[int, int]:
    layers = experts = 0
    for t in tensors:
        if m := LAYER_RE.search(t.name):
            layers = max(layers, int(m.group(1)) + 1)
        if m := EXPERT_RE.search(t.name):
            experts = max(experts, int(m.group(1)) + 1)
    return layers, experts


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
