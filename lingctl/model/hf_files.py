"""The side files that make a checkpoint directory a Hugging Face model repository, as Ling's are on the Hub.

- ``config.json`` carries an ``auto_map``: transformers has no built-in ``bailing_moe``, so its Auto classes
  load the configuration and modeling code named there (with ``trust_remote_code=True``). By default that is
  lingctl's own ``configuration_bailing_moe.py`` / ``modeling_bailing_moe.py`` (``hf_code/``), written beside the
  weights in the plain ``module.Class`` form, so a checkpoint loads offline with no code from the Hub; the
  ``repo--module`` form points at a Hub repository holding such code instead (Ling's own, for example).
- ``tokenizer_config.json`` and ``special_tokens_map.json``: the tokenizer class, the bos/eos/pad tokens and
  Ling's chat template, so ``AutoTokenizer`` loads with its end-of-text token and ``apply_chat_template`` works.
- ``generation_config.json``: the stop and padding ids generation uses.
- Weights larger than ``max_shard_size`` go into ``model-00001-of-0000N.safetensors`` shards with
  ``model.safetensors.index.json``, named and split as ``save_pretrained`` does (5 GB by default).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

import torch

from lingctl.model.checkpoint_files import SHARD_NAME, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG
from lingctl.model.config import LingConfig

# Ling's own Hub repository, holding its configuration_bailing_moe.py / modeling_bailing_moe.py.
LING_CODE_REPO = "inclusionAI/Ling-lite"
CONFIG_MODULE = "configuration_bailing_moe"
MODELING_MODULE = "modeling_bailing_moe"

# save_pretrained's default: shards of at most 5 GB (decimal), so no single file is awkward to move.
DEFAULT_MAX_SHARD_SIZE = "5GB"

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|startoftext|>"
ROLE_START, ROLE_END = "<role>", "</role>"
# Special tokens lingctl's own tokenizers are trained with: the document end (also padding), the document
# start, and Ling's chat role markers, each kept whole as on Ling's tokenizer.
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, ROLE_START, ROLE_END)
# Named special tokens as transformers reads them from tokenizer_config.json.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Ling's chat format: each message as <role>ROLE</role>content, user spelled HUMAN; the prompt for an answer
# ends in <role>ASSISTANT</role>, and a conversation that ends with the assistant's message ends with the
# end-of-text token, as an answer does when the model writes it. For prompts it renders exactly what
# Ling-lite's own template renders.
LING_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = message['role'] | lower %}"
    "{% if role == 'user' %}{% set role = 'HUMAN' %}{% endif %}"
    "{% set role = role | upper %}"
    "{{ '<role>' + role + '</role>' + message['content'] }}"
    "{% if loop.last and role == 'ASSISTANT' and not add_generation_prompt %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}"
)


def auto_map(code_repo: str | None) -> dict[str, str]:
    """The config.json ``auto_map``: ``repo--module.Class`` for a Hub repository, ``module.Class`` for code
    beside the weights (``code_repo`` None or empty)."""
    prefix = f"{code_repo}--" if code_repo else ""
    return {
        "AutoConfig": f"{prefix}{CONFIG_MODULE}.BailingMoeConfig",
        "AutoModel": f"{prefix}{MODELING_MODULE}.BailingMoeModel",
        "AutoModelForCausalLM": f"{prefix}{MODELING_MODULE}.BailingMoeForCausalLM",
    }


def code_files() -> dict[str, bytes]:
    """lingctl's transformers code for a checkpoint directory: file name -> contents (the ``hf_code`` modules)."""
    package = resources.files("lingctl.model.hf_code")
    return {f"{name}.py": package.joinpath(f"{name}.py").read_bytes() for name in (CONFIG_MODULE, MODELING_MODULE)}


def hf_config(config: LingConfig, *, dtype: str, code_repo: str | None) -> dict[str, Any]:
    data = config.to_hf_dict()
    data["torch_dtype"] = dtype
    data["auto_map"] = auto_map(code_repo)
    return data


def generation_config(config: LingConfig) -> dict[str, Any]:
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "do_sample": False,
    }


# -- tokenizer side files ------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken written as a dict
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def tokenizer_files(
    tokenizer_json: str, *, model_max_length: int, base: Mapping[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` for the tokenizer in ``tokenizer_json``.

    ``base`` is the tokenizer_config.json that came with the tokenizer (a checkpoint this run started from):
    its entries are kept, chat template included, and only what it lacks is filled in. The eos token is the
    tokenizer's end-of-text token; pad is eos (as Ling's); bos is set only when the tokenizer has one."""
    data = json.loads(tokenizer_json)
    added = [t for t in data.get("added_tokens", []) if isinstance(t, dict) and isinstance(t.get("id"), int)]
    vocab = {t.get("content") for t in added}
    model_vocab = data.get("model", {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab |= set(model_vocab)
    eos = next((t for t in (EOS_TOKEN, "</s>", "<eos>") if t in vocab), None)
    generated: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN if BOS_TOKEN in vocab else None,
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": LING_CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(t["id"]): {
                "content": t.get("content"),
                "lstrip": bool(t.get("lstrip")),
                "normalized": bool(t.get("normalized")),
                "rstrip": bool(t.get("rstrip")),
                "single_word": bool(t.get("single_word")),
                "special": bool(t.get("special")),
            }
            for t in sorted(added, key=lambda t: t["id"])
        },
    }
    config = {**generated, **dict(base or {})}
    for name in ("bos_token", "eos_token", "pad_token"):
        if _token_text(config.get(name)) is None:
            config[name] = generated[name]
    config = {k: v for k, v in config.items() if v is not None}
    special = {name: config[name] for name in NAMED_TOKENS if _token_text(config.get(name)) is not None}
    return {TOKENIZER_CONFIG: config, SPECIAL_TOKENS_MAP: special}


# -- shards --------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in their given order, cut into consecutive shards of at most ``max_bytes`` each (a tensor larger
    than that gets a shard of its own), as save_pretrained splits a state dict."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return [s for s in shards if s]


def shard_names(count: int) -> list[str]:
    return [SHARD_NAME.format(index=i + 1, total=count) for i in range(count)]


def index_json(weight_map: Mapping[str, str], total_size: int) -> dict[str, Any]:
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
