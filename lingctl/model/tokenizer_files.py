"""What a checkpoint's tokenizer side files say, read as transformers reads them: the chat template and the
named special tokens a template sees. flood renders prompts with them and ``train sft``/``train dpo`` render
their training examples with them, so both see the same text for the same messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lingctl.core.errors import LingctlError
from lingctl.model.checkpoint_files import CHAT_TEMPLATE, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG


def read_side_file(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when the file is absent or holds another JSON value."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LingctlError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def special_tokens(directory: Path) -> dict[str, str]:
    """The tokenizer's named special tokens as strings, as transformers' ``special_tokens_map`` has them and
    passes them to chat templates: every ``*_token`` entry of ``tokenizer_config.json`` (``bos_token``,
    ``eos_token``, ``pad_token``, ... and model-specific ones such as ``image_token``) and of an
    ``extra_special_tokens`` object, each a string or an AddedToken object (its ``content``).
    ``special_tokens_map.json`` is the older place for them: transformers reads it only when the config has
    no ``added_tokens_decoder``, and then its entries win. Lists (``additional_special_tokens``) are not
    named tokens, and templates do not get them."""
    config = read_side_file(directory / TOKENIZER_CONFIG)
    tokens = _named_tokens(config)
    if "added_tokens_decoder" not in config:
        tokens.update(_named_tokens(read_side_file(directory / SPECIAL_TOKENS_MAP)))
    return {name: text for name, text in tokens.items() if text is not None}


def chat_template(directory: Path) -> str | None:
    """``chat_template.jinja`` beside the weights, else ``tokenizer_config.json``'s ``chat_template``
    (a string, or a list of named templates of which "default" is taken), as transformers does."""
    f = directory / CHAT_TEMPLATE
    if f.exists():
        return f.read_text()
    t = read_side_file(directory / TOKENIZER_CONFIG).get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken, serialised
        value = value.get("content")
    return value if isinstance(value, str) else None


def _named_tokens(side_file: dict[str, Any]) -> dict[str, str | None]:
    """``{name: text}`` for the named special tokens in a tokenizer_config.json or special_tokens_map.json;
    None for a name set to null, which unsets it when this file takes precedence."""
    entries = [(name, value) for name, value in side_file.items() if name.endswith("_token")]
    extra = side_file.get("extra_special_tokens")  # a list holds unnamed tokens; an object, named ones
    if isinstance(extra, dict):
        entries += extra.items()
    return {name: _token_text(value) for name, value in entries if value is None or _token_text(value) is not None}
