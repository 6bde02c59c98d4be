"""Ling checkpoint directories in the Hugging Face layout: save, and load (single file or sharded).

A directory holds ``config.json`` (every field explicit), ``model.safetensors`` (``{"format": "pt"}``) or
``model.safetensors.index.json`` + shards, ``tokenizer.json`` and ``generation_config.json``. The same
directory loads here, in flood, and in other tools that read Ling checkpoints.

Loading builds the model on the ``meta`` device (no memory, no init) and assigns the mmap'd tensors, so a
checkpoint is never in memory twice; a dtype change copies only the tensors that need it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from lingctl.core.atomic import atomic_write
from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.model.moe import Dispatch
from lingctl.model.safetensors_io import DEFAULT_METADATA, load_safetensors, read_header, write_safetensors

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"

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


def save_checkpoint(model: LingForCausalLM, directory: Path, *, tokenizer_json: str | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """Write a complete checkpoint directory. Each file is written atomically, weights first and
    ``config.json`` last, so a directory with a config is a complete one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model_state(model)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    saved_dtype = next(iter(state.values())).dtype
    with atomic_write(directory / WEIGHTS) as (_, f):
        write_safetensors(f, state, DEFAULT_METADATA)
    if tokenizer_json is not None:
        with atomic_write(directory / TOKENIZER) as (_, f):
            f.write(tokenizer_json.encode())
    config = model.config
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "pad_token_id": config.pad_token_id, "do_sample": False}
    with atomic_write(directory / GENERATION_CONFIG) as (_, f):
        f.write((json.dumps(generation, indent=2) + "\n").encode())
    data = config.to_hf_dict()
    data["torch_dtype"] = dtype_name(saved_dtype)
    with atomic_write(directory / CONFIG) as (_, f):
        f.write((json.dumps(data, indent=2) + "\n").encode())


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
        raise LingctlError(f"{directory} holds pickled weights; only safetensors checkpoints are supported",
                           hint="convert the checkpoint to safetensors first")
    raise NotFoundError(f"no {WEIGHTS} or {WEIGHTS_INDEX} in {directory}")


def load_config(directory: Path) -> LingConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise NotFoundError(f"checkpoint directory {directory} does not exist")
    return LingConfig.load(directory / CONFIG)


def load_checkpoint(directory: Path, *, dtype: torch.dtype | None = None, dispatch: Dispatch = "sorted",
                    device: str | torch.device = "cpu") -> LingForCausalLM:
    """The model in ``directory``: built on meta, weights assigned from the mmap'd files (strict: a missing
    or unexpected tensor is an error naming it)."""
    directory = Path(directory)
    config = load_config(directory)
    files = weight_files(directory)
    with torch.device("meta"):
        model = LingForCausalLM(config, dispatch)
    expected = set(model_state(model))
    missing = sorted(expected - files.keys())
    unexpected = sorted(files.keys() - expected)
    if missing:
        raise LingctlError(f"{directory}: checkpoint lacks {len(missing)} tensor(s) the config needs, "
                           f"e.g. {', '.join(missing[:3])}")
    if unexpected:
        raise LingctlError(f"{directory}: checkpoint has {len(unexpected)} tensor(s) this model does not use, "
                           f"e.g. {', '.join(unexpected[:3])}")
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    state: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for path, names in sorted(by_file.items()):
        for name, tensor in load_safetensors(path, names).items():
            want = params[name].shape
            if tuple(tensor.shape) != tuple(want):
                raise LingctlError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
                                   f"config.json implies {tuple(want)}")
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


def read_tokenizer_json(directory: Path) -> str | None:
    path = Path(directory) / TOKENIZER
    return path.read_text() if path.exists() else None
