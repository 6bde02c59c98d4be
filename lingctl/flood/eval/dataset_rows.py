"""Rows of the datasets users already have, turned into flood's task items with lm-evaluation-harness's prompts.

A task file may hold rows exactly as the Hugging Face datasets export them (``datasets``' ``to_json``, or the
JSONL files people keep): each row of a known shape becomes a flood item, built the way lm-eval's default task
config for that dataset builds its request, so a score here means what lm-eval's means:

- **HellaSwag** (``ctx_a``, ``ctx_b``, ``endings``, ``label``, ``activity_label``): lm-eval's ``hellaswag``:
  context ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``, choices the preprocessed
  endings (``preprocess`` drops WikiHow's ``[title]``/``[...]`` artifacts and double spaces).
- **ARC** (``question``, ``choices: {text, label}``, ``answerKey``): lm-eval's ``arc_easy``/``arc_challenge``:
  ``"Question: {question}\\nAnswer:"``, choices the texts, the answer the index of ``answerKey`` among the labels.
- **MMLU** (``question``, ``choices`` (four strings), ``answer`` (an index), ``subject``): lm-eval's ``mmlu``:
  the description ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"``, the
  question and the lettered options, ``"Answer:"``; the choices are the letters A-D.
- **PIQA** (``goal``, ``sol1``, ``sol2``, ``label``): ``"Question: {goal}\\nAnswer:"``, choices the two solutions.
- **GSM8K** (``question``, ``answer`` with ``#### N``): a generation item, ``"Question: {question}\\nAnswer:"``,
  stopped at ``Question:``, scored by lm-eval's strict match: the number after ``#### ``, up to 256 new tokens.

Each choice carries lm-eval's target delimiter (a space) in front, as lm-eval's requests do. Where flood still
differs: with few-shot examples, MMLU's description precedes each example (lm-eval writes it once); GSM8K's
number is compared as written, where lm-eval's filters also drop commas, ``$`` and a final period from both sides.
"""

from __future__ import annotations

import re
from typing import Any

from lingctl.core.errors import UsageError

_DELIMITER = " "  # lm-eval's target_delimiter
MMLU_LETTERS = ["A", "B", "C", "D"]
GSM8K_STOP = ["Question:", "</s>", "<|im_end|>"]
GSM8K_REGEX = r"#### (\-?[0-9\.\,]+)"
GSM8K_MAX_TOKENS = 256


def convert_row(obj: dict[str, Any], line: int, where: str) -> dict[str, Any] | None:
    """``obj`` as a flood item when it is a row of a known dataset; None when it is not (it is then read as a
    flood item, or refused as one)."""
    if "context" in obj or "prompt" in obj:
        return None  # flood's own form
    kind = _shape(obj)
    if kind is None:
        return None
    found = next((obj[k] for k in ("id", "ind") if obj.get(k) not in (None, "")), None)
    item_id = str(found) if found is not None else f"line-{line}"
    try:
        item = _CONVERT[kind](obj)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise UsageError(f"{where}: a {kind} row that cannot be read ({exc.__class__.__name__}: {exc})") from None
    return {"id": item_id, **item}


def _shape(obj: dict[str, Any]) -> str | None:
    keys = set(obj)
    if {"ctx_a", "ctx_b", "endings", "label"} <= keys:
        return "HellaSwag"
    if {"question", "choices", "answerKey"} <= keys and isinstance(obj["choices"], dict):
        return "ARC"
    if {"question", "choices", "answer"} <= keys and isinstance(obj["choices"], list):
        return "MMLU"
    if {"goal", "sol1", "sol2", "label"} <= keys:
        return "PIQA"
    if {"question", "answer"} <= keys and isinstance(obj["answer"], str) and "####" in obj["answer"]:
        return "GSM8K"
    return None


def _hellaswag_text(text: str) -> str:
    """lm-eval's ``hellaswag`` preprocess."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(obj: dict[str, Any]) -> dict[str, Any]:
    label = obj["label"]
    if label in ("", None):
        raise ValueError("no label (HellaSwag's test split has none)")
    ctx = obj["ctx_a"] + " " + obj["ctx_b"].capitalize()
    return {
        "context": _hellaswag_text(obj.get("activity_label", "") + ": " + ctx),
        "choices": [_DELIMITER + _hellaswag_text(e) for e in obj["endings"]],
        "answer": int(label),
    }


def _arc(obj: dict[str, Any]) -> dict[str, Any]:
    choices = obj["choices"]
    return {
        "context": f"Question: {obj['question']}\nAnswer:",
        "choices": [_DELIMITER + t for t in choices["text"]],
        "answer": list(choices["label"]).index(obj["answerKey"]),
    }


def _mmlu(obj: dict[str, Any]) -> dict[str, Any]:
    options = obj["choices"]
    if len(options) != len(MMLU_LETTERS):
        raise ValueError(f"{len(options)} choices; MMLU has {len(MMLU_LETTERS)}")
    subject = str(obj.get("subject", "")).replace("_", " ")
    description = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    lettered = "".join(f"\n{letter}. {text}" for letter, text in zip(MMLU_LETTERS, options, strict=True))
    return {
        "context": f"{description}{obj['question'].strip()}{lettered}\nAnswer:",
        "choices": [_DELIMITER + letter for letter in MMLU_LETTERS],
        "answer": int(obj["answer"]),
    }


def _piqa(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "context": f"Question: {obj['goal']}\nAnswer:",
        "choices": [_DELIMITER + obj["sol1"], _DELIMITER + obj["sol2"]],
        "answer": int(obj["label"]),
    }


def _gsm8k(obj: dict[str, Any]) -> dict[str, Any]:
    final = obj["answer"].split("####")[-1].strip()
    return {
        "prompt": f"Question: {obj['question']}\nAnswer:",
        "answer": final,
        "stop": GSM8K_STOP,
        "max_tokens": GSM8K_MAX_TOKENS,
        "regex": GSM8K_REGEX,
    }


_CONVERT = {"HellaSwag": _hellaswag, "ARC": _arc, "MMLU": _mmlu, "PIQA": _piqa, "GSM8K": _gsm8k}
