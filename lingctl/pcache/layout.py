"""What each rank holds: a model's tensors cut by tensor, pipeline and expert parallelism, and the write
items a checkpoint of that state consists of. The tensors themselves come from
:mod:`lingctl.pcache.model_tensors`.

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

import math
from dataclasses import dataclass

import numpy as np

from lingctl.core.errors import UsageError
from lingctl.pcache.model_tensors import DTYPE_SIZES, EXPERT_RE, FLOATING, LAYER_RE, Model, Tensor, dtype_name

AXES = ("tp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-ep-dp-pp"
OPTIMIZERS = ("adamw", "sgd", "none")

# Module names (the part before .weight/.bias) by how tensor parallelism cuts them: Ling's own names and
# the common Hugging Face ones.
_COLUMN = frozenset(
    {
        "query_key_value",
        "qkv_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "gate_up_proj",
        "w1",
        "w3",
        "word_embeddings",
        "embed_tokens",
        "lm_head",
        "dense_h_to_4h",
    }
)
_ROW = frozenset({"dense", "o_proj", "down_proj", "w2", "out_proj", "dense_4h_to_h"})
_EMBEDDINGS = frozenset({"word_embeddings", "embed_tokens", "wte"})

# Kinds of write item: the parameter itself, then the optimizer states.
KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "momentum_buffer")
_OPTIMIZER_STATES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "none": ()}


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
            raise UsageError(
                f"ep {self.ep} does not divide dp {self.dp}",
                hint="expert parallelism is carved out of data parallelism: pick ep | dp",
            )
        self.axes()

    def axes(self) -> list[str]:
        """``order`` as a list of the four axes; ``ep`` may be left out (it then varies just before dp)."""
        names = [a.strip() for a in self.order.split("-") if a.strip()]
        if "ep" not in names and "dp" in names:
            names.insert(names.index("dp"), "ep")
        if sorted(names) != sorted(AXES):
            raise UsageError(
                f"order {self.order!r} must name each of tp, ep, dp, pp once",
                hint=f"e.g. {DEFAULT_ORDER} (fastest-varying first)",
            )
        return names

    def check(self, model: Model) -> None:
        """The model can be cut this way: named values in every message."""
        if model.num_heads is not None and model.num_heads % self.tp:
            raise UsageError(f"tp {self.tp} does not divide the {model.num_heads} attention heads of {model.source}")
        if self.pp > 1 and self.pp > model.num_layers:
            raise UsageError(
                f"pp {self.pp} exceeds the {model.num_layers} layers of {model.source}",
                hint="each pipeline stage needs at least one layer",
            )
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


# -- write items ---------------------------------------------------------------------------------------
def write_items(model: Model, parallelism: Parallelism, optimizer: str = "adamw", dtype: str | None = None) -> Items:
    """Every write item of a checkpoint of ``model`` (and its ``optimizer`` state) trained with
    ``parallelism``; ``dtype`` replaces the floating-point dtype of the parameters."""
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r}", hint=f"choose one of {', '.join(OPTIMIZERS)}")
    if dtype is not None:
        dtype = dtype_name(dtype, "--dtype")
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
        if t.dtype not in FLOATING or not states:
            continue
        for state in (("master",) if trained != "float32" else ()) + states:
            add(f"optim.state.{t.name}.{state}", state_cut, 4, KINDS.index(state))
    size_arr = np.asarray(itemsizes, dtype=np.int64)
    return Items(
        names=names,
        shapes=shapes,
        sizes=np.asarray(elems, dtype=np.int64) * size_arr,
        tensor_sizes=np.asarray(tensor_elems, dtype=np.int64) * size_arr,
        itemsize=size_arr,
        kinds=np.asarray(kinds, dtype=np.int8),
        groups=np.asarray(groups, dtype=np.int64),
        holder_sets=cutter.holder_sets,
    )


def param_dtype(t: Tensor, dtype: str | None) -> str:
    """The dtype ``t`` is trained in: ``dtype`` replaces floating-point dtypes only (integer buffers stay)."""
    return dtype if dtype is not None and t.dtype in FLOATING else t.dtype


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
        layer = LAYER_RE.search(t.name)
        if layer:
            stage = int(layer.group(1)) * p.pp // max(model.num_layers, int(layer.group(1)) + 1)
        else:
            stage = 0 if _EMBEDDINGS & set(t.name.split(".")) else p.pp - 1
        expert = EXPERT_RE.search(t.name)
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
                offsets = zeros[:dim] + (start,) + zeros[dim + 1 :]
                shards.append((offsets, full[:dim] + (length,) + full[dim + 1 :], {"pp": stage, "tp": rank}))
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
