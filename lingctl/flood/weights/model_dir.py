"""A model directory as flood serves it: config, weights (whole or one pipeline stage's share), tokenizer,
chat template and special tokens, stop ids, and a fingerprint that tells whether an output file was written
by this model.

Reads lingctl checkpoints and Ling checkpoints in the Hugging Face layout (``config.json``,
``model.safetensors`` or an index with shards, ``tokenizer.json``, the chat template from
``tokenizer_config.json`` or ``chat_template.jinja``, special tokens from ``tokenizer_config.json`` and
``special_tokens_map.json``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.flood.weights.converted import ConvertedForm
from lingctl.flood.weights.loader import LoadStats, load_streaming
from lingctl.model.checkpoint import load_config, weight_files
from lingctl.model.checkpoint_files import CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.model.safetensors_io import read_entries
from lingctl.model.tokenizer_files import chat_template, read_side_file, special_tokens

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ModelDir:
    path: Path
    config: LingConfig
    converted: ConvertedForm | None = None  # a checkpoint `flood quantize` wrote: int8 already, for one dtype

    @staticmethod
    def open(path: Path, *, option: str = "--model") -> ModelDir:
        path = Path(path)
        if not path.exists():
            raise NotFoundError(f"model directory {path} does not exist")
        if not path.is_dir():
            raise LingctlError(f"{option} must be a checkpoint directory, got a file: {path}")
        if not (path / CONFIG).exists():
            raise NotFoundError(f"no {CONFIG} in {path}", hint=f"point {option} at a checkpoint directory")
        return ModelDir(path=path, config=load_config(path), converted=ConvertedForm.of_directory(path))

    def serving_quantize(self, quantize: str | None, dtype: str) -> str | None:
        """The --quantize a run of this directory uses: the given one, or for a converted checkpoint the one it
        was converted for (a UsageError when the run asks for another, or for another dtype)."""
        if self.converted is None:
            return quantize
        return self.converted.serving_quantize(quantize, dtype, self.path)

    # -- side files -------------------------------------------------------------------------------
    def _json(self, name: str) -> dict[str, Any]:
        return read_side_file(self.path / name)

    def tokenizer_config(self) -> dict[str, Any]:
        return self._json(TOKENIZER_CONFIG)

    def special_tokens(self) -> dict[str, str]:
        """The tokenizer's named special tokens (``tokenizer_files.special_tokens``)."""
        return special_tokens(self.path)

    def has_tokenizer(self) -> bool:
        return (self.path / TOKENIZER).exists()

    def chat_template(self) -> str | None:
        """The checkpoint's chat template (``tokenizer_files.chat_template``)."""
        return chat_template(self.path)

    def eos_ids(self) -> set[int]:
        """Stop ids: the config's eos and ``generation_config.json``'s (an int or a list)."""
        ids: set[int] = {self.config.eos_token_id}
        eos = self._json(GENERATION_CONFIG).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(i for i in eos if isinstance(i, int))
        return ids

    def fingerprint(self) -> str:
        """sha256 over config.json and, per weight file, its size, safetensors header and first/last MiB.
        Hashing every weight byte of a 30 GB checkpoint would take longer than many batches; a retrained
        checkpoint changes the edges of its files, and a different model changes the header."""
        h = hashlib.sha256((self.path / CONFIG).read_bytes())
        for file in sorted(set(weight_files(self.path).values())):
            size = file.stat().st_size
            h.update(f"{file.name}:{size}".encode())
            with open(file, "rb") as f:
                h.update(f.read(1 << 20))
                if size > (2 << 20):
                    f.seek(size - (1 << 20))
                    h.update(f.read())
        return h.hexdigest()

    # -- weights ----------------------------------------------------------------------------------
    def check_weights(self) -> None:
        """Fail early, with the names, when the weight files are unreadable or inconsistent (headers only:
        dtypes, shapes and offsets inside each file)."""
        files = weight_files(self.path)
        for file in sorted(set(files.values())):
            read_entries(file)

    def load(
        self, *, dtype: torch.dtype, quantize: str | None = None, layers: tuple[int, int] | None = None
    ) -> LingForCausalLM:
        """The model, or with ``layers=(first, last)`` only what that pipeline stage needs."""
        return self.load_with_stats(dtype=dtype, quantize=quantize, layers=layers)[0]

    def load_with_stats(
        self, *, dtype: torch.dtype, quantize: str | None = None, layers: tuple[int, int] | None = None
    ) -> tuple[LingForCausalLM, LoadStats]:
        """``load`` and what it read: the weights are streamed from the files into their final form (int8
        rows and scales, or the serving dtype), each file read once (see ``lingctl.flood.weights.loader``)."""
        model, stats = load_streaming(
            self.path,
            self.config,
            weight_files(self.path),
            dtype=dtype,
            quantize=quantize,
            layers=layers,
            converted=self.converted is not None,
        )
        log.info(
            "loaded %d tensors (%.2f GB read) from %d file(s) in %.1f s",
            stats.tensors,
            stats.bytes_read / 1e9,
            stats.files,
            stats.seconds,
        )
        return model, stats
