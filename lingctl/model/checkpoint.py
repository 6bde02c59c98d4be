"""Ling checkpoint directories in the Hugging Face layout: save, and load (single file or sharded).

A directory holds ``config.json`` (every field explicit, with an ``auto_map``), ``model.safetensors``
(``{"format": "pt"}``) or ``model.safetensors.index.json`` + shards, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json`` and ``generation_config.json`` (see ``hf_files``). The
same directory loads here, in flood, in transformers and in other tools that read Ling checkpoints.

Loading builds the model on the ``meta`` device (no memory, no init) and assigns the mmap'd tensors, so a
checkpoint is never in memory twice; a dtype change copies only the tensors that need it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.core.units import parse_size
from lingctl.model.checkpoint_files import CONFIG, GENERATION_CONFIG, TOKENIZER, WEIGHTS, WEIGHTS_INDEX
from lingctl.model.config import LingConfig
from lingctl.model.hf_files import (
    DEFAULT_MAX_SHARD_SIZE,
    code_files,
    generation_config,
    hf_config,
    index_json,
    plan_shards,
    shard_names,
    tensor_bytes,
    tokenizer_files,
)
from lingctl.model.ling import LingForCausalLM
from lingctl.model.moe import Dispatch
from lingctl.model.safetensors_io import DEFAULT_METADATA, load_safetensors, read_header, write_safetensors

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise LingctlError(f"unsupported dtype {name!r}; choose one of {', '.join(_DTYPE_NAMES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPE_NAMES.items()}[dtype]


def model_state(model: LingForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds: tied ``lm_head.weight`` is omitted, as Hugging Face does."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(
    model: LingForCausalLM,
    directory: Path,
    *,
    tokenizer_json: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tokenizer_config: Mapping[str, Any] | None = None,
    code_repo: str | None = None,
) -> None:
    """Write a complete checkpoint directory in the Hugging Face layout (see ``hf_files``).

    Each file is written atomically, weights first and ``config.json`` last, so a directory with a config is
    a complete one. Weights over ``max_shard_size`` are split into shards with an index. ``tokenizer_config``
    is the tokenizer_config.json that came with the tokenizer, kept (only what it lacks is filled in);
    ``code_repo`` is the Hub repository config.json's auto_map sends transformers to for the modeling code; None
    (the default) writes lingctl's own code beside the weights and names it there.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model_state(model)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    saved_dtype = next(iter(state.values())).dtype
    shards = plan_shards(((k, tensor_bytes(v)) for k, v in state.items()), parse_size(max_shard_size))
    if len(shards) == 1:
        with atomic_write(directory / WEIGHTS) as (_, f):
            write_safetensors(f, state, DEFAULT_METADATA)
    else:
        weight_map: dict[str, str] = {}
        for names, file in zip(shards, shard_names(len(shards))):
            with atomic_write(directory / file) as (_, f):
                write_safetensors(f, {k: state[k] for k in names}, DEFAULT_METADATA)
            weight_map.update(dict.fromkeys(names, file))
        total = sum(tensor_bytes(v) for v in state.values())
        _write_json(directory / WEIGHTS_INDEX, index_json(weight_map, total))
    config = model.config
    if tokenizer_json is not None:
        with atomic_write(directory / TOKENIZER) as (_, f):
            f.write(tokenizer_json.encode())
        files = tokenizer_files(tokenizer_json, model_max_length=config.max_position_embeddings, base=tokenizer_config)
        for name, content in files.items():
            _write_json(directory / name, content)
    _write_json(directory / GENERATION_CONFIG, generation_config(config))
    if not code_repo:
        for name, source in code_files().items():
            with atomic_write(directory / name) as (_, f):
                f.write(source)
    _write_json(directory / CONFIG, hf_config(config, dtype=dtype_name(saved_dtype), code_repo=code_repo))


def _write_json(path: Path, data: Any) -> None:
    with atomic_write(path) as (_, f):
        f.write((json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode())


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index of a sharded checkpoint or the single file."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LingctlError(f"{index}: not a safetensors index (no weight_map)") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS
    if single.exists():
        _, header = read_header(single)
        return {name: single for name in header if name != "__metadata__"}
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise LingctlError(
            f"{directory} holds pickled weights; only safetensors checkpoints are supported",
            hint="convert the checkpoint to safetensors first",
        )
    raise NotFoundError(f"no {WEIGHTS} or {WEIGHTS_INDEX} in {directory}")


def load_config(directory: Path) -> LingConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise NotFoundError(f"checkpoint directory {directory} does not exist")
    return LingConfig.load(directory / CONFIG)


def _check_names(directory: Path, files: dict[str, Path], expected: set[str]) -> None:
    missing = sorted(expected - files.keys())
    unexpected = sorted(files.keys() - expected)
    if missing:
        raise LingctlError(
            f"{directory}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {', '.join(missing[:3])}"
        )
    if unexpected:
        raise LingctlError(
            f"{directory}: checkpoint has {len(unexpected)} tensor(s) this model does not use, "
            f"e.g. {', '.join(unexpected[:3])}"
        )


def _tensors_by_file(files: dict[str, Path]) -> list[tuple[Path, list[str]]]:
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    return sorted(by_file.items())


def _refuse_quantized(directory: Path) -> None:
    """A quantized checkpoint (``flood quantize`` writes one) holds int8 weights for inference only."""
    try:
        data = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError):
        return  # load_config has read it already; nothing more to say here
    q = data.get("quantization_config") if isinstance(data, dict) else None
    method = q.get("quant_method", "unnamed") if isinstance(q, dict) else None
    if method:
        raise LingctlError(
            f"{directory} is a quantized checkpoint ({method}), for inference only",
            hint="use the original checkpoint it was made from",
        )


def load_checkpoint(
    directory: Path,
    *,
    dtype: torch.dtype | None = None,
    dispatch: Dispatch = "sorted",
    device: str | torch.device = "cpu",
) -> LingForCausalLM:
    """The model in ``directory``: built on meta, weights assigned from the mmap'd files (strict: a missing
    or unexpected tensor is an error naming it)."""
    directory = Path(directory)
    config = load_config(directory)
    _refuse_quantized(directory)
    files = weight_files(directory)
    with torch.device("meta"):
        model = LingForCausalLM(config, dispatch)
    _check_names(directory, files, set(model_state(model)))
    state: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for path, names in _tensors_by_file(files):
        for name, tensor in load_safetensors(path, names).items():
            want = params[name].shape
            if tuple(tensor.shape) != tuple(want):
                raise LingctlError(
                    f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(want)}"
                )
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            state[name] = tensor.to(device) if torch.device(device).type != "cpu" else tensor
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.word_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.word_embeddings.weight
    log.debug("loaded %d tensors from %s", len(state), directory)
    return model


def load_weights_into(model: LingForCausalLM, directory: Path) -> int:
    """Copy the weights of the checkpoint in ``directory`` into ``model``'s parameters (converted to their
    dtype), file by file from the mapped shards, so memory holds the model once plus what the page cache
    keeps. Every name and shape must match; returns the number of bytes read."""
    directory = Path(directory)
    files = weight_files(directory)
    _check_names(directory, files, set(model_state(model)))
    params = dict(model.named_parameters())
    read = 0
    with torch.no_grad():
        for path, names in _tensors_by_file(files):
            for name, tensor in load_safetensors(path, names).items():
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise LingctlError(
                        f"{path}: tensor {name} has shape {tuple(tensor.shape)}, the model's is {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                read += tensor.numel() * tensor.element_size()
    return read


def read_tokenizer_json(directory: Path) -> str | None:
    path = Path(directory) / TOKENIZER
    return path.read_text() if path.exists() else None
