"""What a run starts from besides its data: a checkpoint (``--init-from``) and a tokenizer (``--tokenizer``),
each a local path or a Hugging Face Hub id resolved through the local cache.

A checkpoint may be lingctl's or one in the Hub's layout (sharded or not); its tokenizer_config.json (chat
template, special tokens) is carried into the run's checkpoints, and so is where its auto_map finds Ling's code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError, NotFoundError, UsageError
from lingctl.model.checkpoint import load_config, weight_files
from lingctl.model.checkpoint_files import CONFIG, TOKENIZER, TOKENIZER_CONFIG
from lingctl.model.config import LingConfig
from lingctl.model.hub import is_repo_id, resolve_model_dir


@dataclass(kw_only=True, slots=True)
class InitSource:
    spec: str  # as the user gave it
    directory: Path
    config: LingConfig
    tokenizer_config: dict[str, Any] | None

    @property
    def tokenizer(self) -> Path | None:
        path = self.directory / TOKENIZER
        return path if path.is_file() else None


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file is absent; one line when it is not a JSON object."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LingctlError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LingctlError(f"{path}: expected a JSON object")
    return data


def open_init_source(spec: str) -> InitSource:
    """The checkpoint ``--init-from`` names, checked before any data is read: config, weight files present."""
    directory = resolve_model_dir(spec, option="--init-from")
    if not directory.is_dir():
        raise UsageError(f"--init-from must be a checkpoint directory or a Hub id, got a file: {spec}")
    if not (directory / CONFIG).is_file():
        raise NotFoundError(f"no {CONFIG} in {directory}", hint="point --init-from at a checkpoint directory")
    config = load_config(directory)
    weight_files(directory)  # no weights (or pickled ones only): one line now, not after the data is read
    return InitSource(
        spec=spec,
        directory=directory,
        config=config,
        tokenizer_config=read_json_object(directory / TOKENIZER_CONFIG),
    )


def tokenizer_source(spec: str) -> tuple[Path, dict[str, Any] | None]:
    """``--tokenizer``: a tokenizer.json file, a directory holding one, or a Hub id; with the
    tokenizer_config.json beside it, if any."""
    path = Path(spec)
    if path.is_file():
        return path, read_json_object(path.parent / TOKENIZER_CONFIG)
    if not path.exists() and is_repo_id(spec):
        path = resolve_model_dir(spec, option="--tokenizer")
    if path.is_dir():
        file = path / TOKENIZER
        if not file.is_file():
            raise NotFoundError(
                f"no {TOKENIZER} in {path}",
                hint="--tokenizer takes a tokenizer.json, a directory holding one, or a Hub id",
            )
        return file, read_json_object(path / TOKENIZER_CONFIG)
    raise NotFoundError(f"tokenizer not found: {spec}")
