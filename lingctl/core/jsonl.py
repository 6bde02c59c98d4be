"""One line of a JSONL file read as a JSON object: the parse every JSONL reader of lingctl shares (training
data, metrics and incidents, batch requests and outputs, evaluation tasks).

Each reader decides what a bad line means for it (a request that fails alone, a record skipped with a
warning, a usage error naming FILE:LINE); what counts as bad, and its reason in words, is decided here once.
"""

from __future__ import annotations

import json
from typing import Any


class BadLine(ValueError):
    """A line that is not one JSON object; the message says why in a few words (no position for
    ``not JSON``: callers name FILE:LINE)."""


def _no_constant(name: str) -> Any:
    # NaN and Infinity are Python's extensions to JSON: no other writer produces them, no reader takes them.
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes | str, *, nan: bool = False) -> Any:
    """The JSON value on the line ``raw`` (its newline may be included), or ``BadLine``: not UTF-8, not JSON,
    a number too long to read, nested without end, or NaN/Infinity (taken only with ``nan``: lingctl's own
    metrics hold a NaN loss as Python's json writes it)."""
    try:
        return json.loads(raw, parse_constant=None if nan else _no_constant)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    except UnicodeDecodeError:
        raise BadLine("not UTF-8 text") from None
    except ValueError as exc:  # an integer too long to read, NaN/Infinity
        raise BadLine(f"not valid JSON: {exc}") from None
    except RecursionError:
        raise BadLine("JSON nested too deeply") from None


def parse_object(raw: bytes | str) -> dict[str, Any]:
    """``parse_json``, and ``BadLine`` too for a value that is not an object."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise BadLine(f"{kind_of(value)}, not a JSON object")
    return value


def kind_of(value: Any) -> str:
    """A JSON value's kind in words, for messages: ``a list``, ``a number``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"
