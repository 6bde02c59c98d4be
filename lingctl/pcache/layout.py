"""What each rank holds: a model's tensors cut by tensor, pipeline and expert parallelism, and the write
items a checkpoint of that state consists of.

The model of a training job (Megatron-style, with experts carved out of data parallelism):

- World = tp * pp * dp ranks. ``order`` names the axes fastest-varying first (default ``tp-ep-dp-pp``:
  ranks 0..tp-1 are one tensor-parallel group). ``ep`` is carved out of ``dp``: an expert-parallel group of
  ``ep`` ranks sits inside the data-parallel group, and the ``dp`` axis of ``order`` counts the
  ``dp / ep`` expert-data-parallel replicas.
- Non-expert weights are split ``tp`` ways along their parallel dim: column-parallel layers (q/k/v, MLP
  gate/up, shared experts' gate/up, the embedding and the LM head) along dim 0 (out features or
  vocabulary), row-parallel layers (attention output, MLP down) along dim 1 (in features). A column-parallel
  bias is split with its outputs; norms, the router and row-parallel biases are replicated across tp.
  Uneven dims are cut as ``torch.chunk`` cuts them (DTensor ``Shard`` does the same).
- Layers are split evenly over ``pp`` stages (layer i on stage ``i * pp // layers``); embeddings sit on the
  first stage, the final norm, the head and any other tensor outside the layers on the last.
- Routed experts (``...experts.N...``) are split ``ep`` ways, each ep rank holding ``num_experts / ep``
  consecutive experts whole (not tp-split), so every tp rank of the stage holds them too.
- Whatever is left is replicated across the remaining data-parallel ranks. The ranks holding a copy of a
  write item are its holders: any of them may write it.

Optimizer state, per floating-point parameter: ``adamw`` keeps fp32 ``exp_avg`` and ``exp_avg_sq``,
``sgd`` one fp32 ``momentum_buffer``; with any optimizer a parameter whose dtype is not fp32 also has an
fp32 master copy (mixed precision). AdamW's ``step`` counters are a few bytes and left out. With
``shard_optimizer`` (ZeRO-1), each optimizer item is cut along dim 0 into ``torch.chunk`` pieces over the
item's data-parallel replicas (``dp`` of them; ``dp / ep`` for experts), piece j held by replica j only: a
tp-split tensor's pieces are then rank-unique, while a tensor replicated across tp (norms, router, experts)
keeps one copy of each piece per tp rank.

Items are listed in state-dict order (parameters in model order, then each parameter's optimizer states),
which is the order DCP's planner sees them in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lingctl.core.errors import LingctlError, UsageError

AXES = ("tp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-ep-dp-pp"
OPTIMIZERS = ("adamw", "sgd", "none")

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
_FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
# safetensors header names -> the torch names used here.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}

# Module names (the part before .weight/.bias) by how tensor parallelism cuts them: Ling's own names and
# the common Hugging Face ones.
_COLUMN = frozenset({"query_key_value", "qkv_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                     "gate_up_proj", "w1", "w3", "word_embeddings", "embed_tokens", "lm_head", "dense_h_to_4h"})
_ROW = frozenset({"dense", "o_proj", "down_proj", "w2", "out_proj", "dense_4h_to_h"})
_EMBEDDINGS = frozenset({"word_embeddings", "embed_tokens", "wte"})
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# Kinds of write item: the parameter itself, then the optimizer states.
KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "momentum_buffer")
_OPTIMIZER_STATES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "none": ()}


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


@dataclass(kw_only=True, slots=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER  # axes fastest-varying first; "dp" there counts the dp / ep replicas
    shard_optimizer: bool = False  # ZeRO-1: optimizer state cut across the data-parallel replicas

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{axis} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise UsageError(f"ep {self.ep} does not divide dp {self.dp}",
                             hint="expert parallelism is carved out of data parallelism: pick ep | dp")
        self.axes()

    def axes(self) -> list[str]:
        """``order`` as a list of the four axes; ``ep`` may be left out (it then varies just before dp)."""
        names = [a.strip() for a in self.order.split("-") if a.strip()]
        if "ep" not in names and "dp" in names:
            names.insert(names.index("dp"), "ep")
        if sorted(names) != sorted(AXES):
            raise UsageError(f"order {self.order!r} must name each of tp, ep, dp, pp once",
                             hint=f"e.g. {DEFAULT_ORDER} (fastest-varying first)")
        return names

    def check(self, model: Model) -> None:
        """The model can be cut this way: named values in every message."""
        if model.num_heads is not None and model.num_heads % self.tp:
            raise UsageError(f"tp {self.tp} does not divide the {model.num_heads} attention heads of {model.source}")
        if self.pp > 1 and self.pp > model.num_layers:
            raise UsageError(f"pp {self.pp} exceeds the {model.num_layers} layers of {model.source}",
                             hint="each pipeline stage needs at least one layer")
        if self.ep > 1:
            if not model.num_experts:
                raise UsageError(f"ep {self.ep} given, but {model.source} has no routed experts")
            if model.num_experts % self.ep:
                raise UsageError(f"ep {self.ep} does not divide the {model.num_experts} experts of {model.source}")

    def coordinates(self) -> dict[str, np.ndarray]:
        """Each rank's index on every axis: tp, ep, edp (expert-data-parallel), pp, and dpi, its index in the
        full data-parallel group (ep and edp combined in the order they vary)."""
        sizes = {"tp": self.tp, "ep": self.ep, "dp": self.dp // self.ep, "pp": self.pp}
        ranks = np.arange(self.world_size, dtype=np.int64)
        coords: dict[str, np.ndarray] = {}
        stride = 1
        axes = self.axes()
        for axis in axes:
            coords[axis] = (ranks // stride) % sizes[axis]
            stride *= sizes[axis]
        coords["edp"] = coords.pop("dp")
        if axes.index("ep") < axes.index("dp"):
            coords["dpi"] = coords["ep"] + self.ep * coords["edp"]
        else:
            coords["dpi"] = coords["edp"] + sizes["dp"] * coords["ep"]
        return coords


@dataclass(kw_only=True, slots=True)
class Items:
    """Write items: one per (tensor or optimizer state, shard) that some rank holds, in state-dict order."""

    names: list[str]  # e.g. model.layers.3.attention.dense.weight[:, 672:1344]
    shapes: list[tuple[int, ...]]
    sizes: np.ndarray  # int64 bytes
    tensor_sizes: np.ndarray  # int64 bytes of the whole tensor the item is a piece of
    itemsize: np.ndarray  # int64 bytes per element
    kinds: np.ndarray  # int8 index into KINDS
    groups: np.ndarray  # int64 index into holder_sets
    holder_sets: list[tuple[int, ...]]  # ranks holding a copy, ascending

    def __len__(self) -> int:
        return len(self.names)

    def holders(self, i: int) -> tuple[int, ...]:
        return self.holder_sets[int(self.groups[i])]

    def held_bytes(self, world_size: int) -> np.ndarray:
        """Bytes every rank holds (each item counted on each of its holders): what ``async_save`` stages."""
        per_group = np.bincount(self.groups, weights=self.sizes, minlength=len(self.holder_sets))
        held = np.zeros(world_size, dtype=np.float64)
        for g, ranks in enumerate(self.holder_sets):
            held[list(ranks)] += per_group[g]
        return held.round().astype(np.int64)


# -- models ------------------------------------------------------------------------------------------
def load_model(source: str) -> Model:
    """A preset name, a checkpoint directory (config.json + safetensors; only headers are read), or a JSON
    file listing ``[{"name", "shape", "dtype"}]``."""
    from lingctl.model.presets import PRESETS, preset

    if source in PRESETS:
        config = preset(source)
        return Model(source=source, tensors=ling_tensors(config), num_layers=config.num_hidden_layers,
                     num_experts=config.num_experts, num_heads=config.num_attention_heads)
    path = Path(source).expanduser()
    if path.is_dir():
        return _directory_model(path)
    if path.is_file() and path.suffix == ".json":
        return _listed_model(path)
    if path.exists():
        raise UsageError(f"--model {source}: expected a checkpoint directory or a .json tensor list")
    if "/" in source or path.suffix:
        raise UsageError(f"--model {source}: no such directory or file")
    raise UsageError(f"unknown model preset {source!r}",
                     hint=f"choose one of {', '.join(PRESETS)}, or give a checkpoint directory or tensors .json")


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
            index, rest = name[len(prefix):].split(".", 1)
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


_INIT_FUNCTIONS = frozenset({"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_",
                             "fill_", "zero_"})


def _directory_model(path: Path) -> Model:
    from lingctl.model.checkpoint import weight_files
    from lingctl.model.safetensors_io import read_header

    config: dict[str, Any] = {}
    config_path = path / "config.json"
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
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
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
    return Model(source=str(path), tensors=tensors, num_layers=int(config.get("num_hidden_layers") or layers),
                 num_experts=experts, num_heads=int(heads) if heads else None)


def _listed_model(path: Path) -> Model:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"{path}: expected a non-empty list of {{\"name\", \"shape\", \"dtype\"}} objects")
    tensors = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise UsageError(f"{path}: entry {i} needs a \"name\" string")
        name, shape = entry["name"], entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise UsageError(f"{path}: {name}: shape must be a list of non-negative integers, got {shape!r}")
        dtype = _dtype_name(entry.get("dtype", "bfloat16"), f"{path}: {name}")
        if name in seen:
            raise UsageError(f"{path}: tensor {name} is listed twice")
        seen.add(name)
        tensors.append(Tensor(name=name, shape=tuple(shape), dtype=dtype))
    layers, experts = _counts(tensors)
    return Model(source=str(path), tensors=tensors, num_layers=layers, num_experts=experts, num_heads=None)


def _dtype_name(value: Any, where: str) -> str:
    name = _SAFETENSORS_DTYPES.get(value, value) if isinstance(value, str) else value
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise UsageError(f"{where}: unknown dtype {value!r}", hint=f"use one of {', '.join(DTYPE_SIZES)}")
    return name


def _counts(tensors: list[Tensor]) -> tuple[int, int]:
    layers = experts = 0
    for t in tensors:
        if m := _LAYER_RE.search(t.name):
            layers = max(layers, int(m.group(1)) + 1)
        if m := _EXPERT_RE.search(t.name):
            experts = max(experts, int(m.group(1)) + 1)
    return layers, experts


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


# -- write items ---------------------------------------------------------------------------------------
def write_items(model: Model, parallelism: Parallelism, optimizer: str = "adamw", dtype: str | None = None) -> Items:
    """Every write item of a checkpoint of ``model`` (and its ``optimizer`` state) trained with
    ``parallelism``; ``dtype`` replaces the floating-point dtype of the parameters."""
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r}", hint=f"choose one of {', '.join(OPTIMIZERS)}")
    if dtype is not None:
        dtype = _dtype_name(dtype, "--dtype")
    parallelism.validate()
    parallelism.check(model)
    cutter = _Cutter(model, parallelism)
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    elems: list[int] = []
    tensor_elems: list[int] = []
    itemsizes: list[int] = []
    kinds: list[int] = []
    groups: list[int] = []

    def add(base: str, cut: _Cut, itemsize: int, kind: int) -> None:
        n = len(cut.suffixes)
        names.extend([base + s for s in cut.suffixes] if n > 1 or cut.suffixes[0] else [base])
        shapes.extend(cut.shapes)
        elems.extend(cut.elems)
        tensor_elems.extend([cut.tensor_elems] * n)
        groups.extend(cut.groups)
        itemsizes.extend([itemsize] * n)
        kinds.extend([kind] * n)

    states = _OPTIMIZER_STATES[optimizer]
    cuts = [cutter.cuts(t) for t in model.tensors]
    dtypes = [param_dtype(t, dtype) for t in model.tensors]
    for t, (param_cut, _), trained in zip(model.tensors, cuts, dtypes):
        add(t.name, param_cut, DTYPE_SIZES[trained], 0)
    for t, (_, state_cut), trained in zip(model.tensors, cuts, dtypes):
        if t.dtype not in _FLOATING or not states:
            continue
        for state in (("master",) if trained != "float32" else ()) + states:
            add(f"optim.state.{t.name}.{state}", state_cut, 4, KINDS.index(state))
    size_arr = np.asarray(itemsizes, dtype=np.int64)
    return Items(names=names, shapes=shapes, sizes=np.asarray(elems, dtype=np.int64) * size_arr,
                 tensor_sizes=np.asarray(tensor_elems, dtype=np.int64) * size_arr, itemsize=size_arr,
                 kinds=np.asarray(kinds, dtype=np.int8), groups=np.asarray(groups, dtype=np.int64),
                 holder_sets=cutter.holder_sets)


def param_dtype(t: Tensor, dtype: str | None) -> str:
    """The dtype ``t`` is trained in: ``dtype`` replaces floating-point dtypes only (integer buffers stay)."""
    return dtype if dtype is not None and t.dtype in _FLOATING else t.dtype


@dataclass(slots=True)
class _Cut:
    """The pieces one tensor (or one optimizer state of it) is written in: name suffixes, shapes, element
    counts and holder sets."""

    suffixes: list[str]
    shapes: list[tuple[int, ...]]
    elems: list[int]
    groups: list[int]
    tensor_elems: int


class _Cutter:
    """Cuts tensors into shards and holder sets. Tensors of one shape, stage, parallel dim and expert
    owner are cut alike (every expert of a layer, every layer's norms), so each cut is made once."""

    def __init__(self, model: Model, p: Parallelism) -> None:
        self.model = model
        self.p = p
        self.coords = p.coordinates()
        self.holder_sets: list[tuple[int, ...]] = []
        self._groups: dict[tuple, int] = {}
        self._cuts: dict[tuple, tuple[_Cut, _Cut]] = {}

    def group(self, **where: int) -> int:
        key = tuple(sorted(where.items()))
        g = self._groups.get(key)
        if g is None:
            mask = np.ones(self.p.world_size, dtype=bool)
            for axis, value in key:
                mask &= self.coords[axis] == value
            g = self._groups[key] = len(self.holder_sets)
            self.holder_sets.append(tuple(np.flatnonzero(mask).tolist()))
        return g

    def cuts(self, t: Tensor) -> tuple[_Cut, _Cut]:
        """The parameter's cut and its optimizer states' cut (ZeRO-split when the optimizer is sharded)."""
        p, model = self.p, self.model
        layer = _LAYER_RE.search(t.name)
        if layer:
            stage = int(layer.group(1)) * p.pp // max(model.num_layers, int(layer.group(1)) + 1)
        else:
            stage = 0 if _EMBEDDINGS & set(t.name.split(".")) else p.pp - 1
        expert = _EXPERT_RE.search(t.name)
        owner = int(expert.group(1)) * p.ep // model.num_experts if expert and model.num_experts else -1
        dim = _tp_dim(t) if owner < 0 and p.tp > 1 else None
        key = (t.shape, stage, owner, dim)
        found = self._cuts.get(key)
        if found is None:
            found = self._cuts[key] = self._cut(t.shape, stage, owner, dim)
        return found

    def _cut(self, full: tuple[int, ...], stage: int, owner: int, dim: int | None) -> tuple[_Cut, _Cut]:
        p = self.p
        zeros = (0,) * len(full)
        # Shards: (offsets, shape, holder-set conditions); then the data-parallel axis ZeRO cuts along.
        if owner >= 0:
            shards = [(zeros, full, {"pp": stage, "ep": owner})]
            zero_axis, zero_size = "edp", p.dp // p.ep
        elif dim is None:
            shards = [(zeros, full, {"pp": stage})]
            zero_axis, zero_size = "dpi", p.dp
        else:
            shards = []
            for rank, (start, length) in enumerate(_chunks(full[dim], p.tp)):
                offsets = zeros[:dim] + (start,) + zeros[dim + 1:]
                shards.append((offsets, full[:dim] + (length,) + full[dim + 1:], {"pp": stage, "tp": rank}))
            zero_axis, zero_size = "dpi", p.dp
        param = _Cut([], [], [], [], math.prod(full))
        state = _Cut([], [], [], [], math.prod(full))
        for offsets, shape, where in shards:
            g = self.group(**where)
            for cut in (param, state) if not p.shard_optimizer or zero_size == 1 or not shape else (param,):
                cut.suffixes.append(_suffix(offsets, shape, full))
                cut.shapes.append(shape)
                cut.elems.append(math.prod(shape))
                cut.groups.append(g)
            if p.shard_optimizer and zero_size > 1 and shape:
                for j, (start, rows) in enumerate(_chunks(shape[0], zero_size)):
                    piece, piece_shape = (offsets[0] + start,) + offsets[1:], (rows,) + shape[1:]
                    state.suffixes.append(_suffix(piece, piece_shape, full))
                    state.shapes.append(piece_shape)
                    state.elems.append(math.prod(piece_shape))
                    state.groups.append(self.group(**where, **{zero_axis: j}))
        return param, state


def _tp_dim(t: Tensor) -> int | None:
    parts = t.name.rsplit(".", 2)
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if module in _COLUMN and t.shape:
        return 0
    if module in _ROW and leaf == "weight" and len(t.shape) >= 2:
        return 1
    return None


def _chunks(length: int, pieces: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the non-empty pieces ``torch.chunk`` cuts ``length`` into."""
    if length == 0:
        return [(0, 0)]
    size = -(-length // pieces)
    return [(s, min(size, length - s)) for s in range(0, length, size)]


def _suffix(offsets: tuple[int, ...], shape: tuple[int, ...], full: tuple[int, ...]) -> str:
    """``[a:b]`` / ``[:, a:b]`` for a piece of a tensor, in numpy slice notation; empty for the whole."""
    parts = [":" if o == 0 and n == f else f"{o}:{o + n}" for o, n, f in zip(offsets, shape, full)]
    while parts and parts[-1] == ":":
        parts.pop()
    return "[" + ", ".join(parts) + "]" if parts else ""
