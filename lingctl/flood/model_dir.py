"""A model directory as flood serves it: config, weights (whole or one pipeline stage's share), tokenizer,
chat template, stop ids, and a fingerprint that tells whether an output file was written by this model.

Reads lingctl checkpoints and Ling checkpoints in the Hugging Face layout (``config.json``,
``model.safetensors`` or an index with shards, ``tokenizer.json``, and the chat template from
``tokenizer_config.json`` or ``chat_template.jinja``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.model.checkpoint import CONFIG, GENERATION_CONFIG, TOKENIZER, load_config, model_state, weight_files
from lingctl.model.config import LingConfig
from lingctl.model.ling import LingForCausalLM
from lingctl.model.safetensors_io import load_safetensors, read_header

log = logging.getLogger(__name__)

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(kw_only=True, slots=True)
class ModelDir:
    path: Path
    config: LingConfig

    @staticmethod
    def open(path: Path) -> ModelDir:
        path = Path(path)
        if not path.exists():
            raise NotFoundError(f"model directory {path} does not exist")
        if not path.is_dir():
            raise LingctlError(f"--model must be a checkpoint directory, got a file: {path}")
        if not (path / CONFIG).exists():
            raise NotFoundError(f"no {CONFIG} in {path}", hint="point --model at a checkpoint directory")
        return ModelDir(path=path, config=load_config(path))

    # -- side files -------------------------------------------------------------------------------
    def _json(self, name: str) -> dict[str, Any]:
        p = self.path / name
        if not p.exists():
            return {}
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LingctlError(f"{p}: not valid JSON ({exc})") from None
        return data if isinstance(data, dict) else {}

    def tokenizer_config(self) -> dict[str, Any]:
        return self._json(TOKENIZER_CONFIG)

    def has_tokenizer(self) -> bool:
        return (self.path / TOKENIZER).exists()

    def chat_template(self) -> str | None:
        """``chat_template.jinja`` beside the weights, else ``tokenizer_config.json``'s ``chat_template``
        (a string, or a list of named templates of which "default" is taken), as transformers does."""
        f = self.path / CHAT_TEMPLATE_FILE
        if f.exists():
            return f.read_text()
        t = self.tokenizer_config().get("chat_template")
        if isinstance(t, list):
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            t = named.get("default")
        return t if isinstance(t, str) else None

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
        """Fail early, with the names, when the weight files do not hold what config.json describes."""
        files = weight_files(self.path)
        for file in set(files.values()):
            read_header(file)

    def load(self, *, dtype: torch.dtype, quantize: str | None = None,
             layers: tuple[int, int] | None = None) -> LingForCausalLM:
        """The model, or with ``layers=(first, last)`` only what that pipeline stage needs (the other layers
        stay on the meta device and cost nothing). Weights are mmap'd; a dtype change or quantization
        copies one tensor at a time."""
        config = self.config
        n = config.num_hidden_layers
        first, last = layers if layers is not None else (0, n)
        with torch.device("meta"):
            # a copy: baking NormHead below switches norm_head off on the model's own config
            model = LingForCausalLM(dataclasses.replace(config))

        def wanted(name: str) -> bool:
            if name.startswith("model.layers."):
                return first <= int(name.split(".")[2]) < last
            if name.startswith("model.word_embeddings."):
                return first == 0 or (last == n and config.tie_word_embeddings)
            return last == n  # model.norm, lm_head

        files = weight_files(self.path)
        names = [k for k in model_state(model) if wanted(k)]
        missing = [k for k in names if k not in files]
        if missing:
            raise LingctlError(f"{self.path}: checkpoint lacks {len(missing)} tensor(s) the config needs, "
                               f"e.g. {', '.join(missing[:3])}")
        params = dict(model.named_parameters())
        by_file: dict[Path, list[str]] = {}
        for k in names:
            by_file.setdefault(files[k], []).append(k)
        state: dict[str, torch.Tensor] = {}
        for file, keys in sorted(by_file.items()):
            for k, t in load_safetensors(file, keys).items():
                if tuple(t.shape) != tuple(params[k].shape):
                    raise LingctlError(f"{file}: tensor {k} has shape {tuple(t.shape)}, config.json implies "
                                       f"{tuple(params[k].shape)}")
                if quantize is None and t.dtype != dtype:
                    t = t.to(dtype)
                state[k] = t
        if config.tie_word_embeddings and "model.word_embeddings.weight" in state:
            state["lm_head.weight"] = state["model.word_embeddings.weight"]
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.word_embeddings.weight
        model.eval()
        if last == n:
            model.normalize_head_()  # bake NormHead once instead of per step (what Ling's code does in eval)
        if quantize == "int8":
            from lingctl.flood.quantize import quantize_model_

            report = quantize_model_(model, dtype)
            log.info("int8: %d linear layers, %.2f GB -> %.2f GB", report.layers, report.bytes_before / 1e9,
                     report.bytes_after / 1e9)
            for p in model.parameters():
                if p.device.type != "meta" and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        elif quantize is not None:
            raise LingctlError(f"unknown quantization {quantize!r}; supported: int8")
        return model
