"""The one JSONL line parse every reader shares: what counts as a bad line, and its reason."""

from __future__ import annotations

import pytest

from lingctl.core.jsonl import BadLine, parse_json, parse_object


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"a": ', "not valid JSON"),
        (b'{"a": "\x80"}', "not UTF-8"),
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"a": ' + b"7" * 5000 + b"}", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_bad_lines_say_why(raw: bytes, reason: str) -> None:
    with pytest.raises(BadLine, match=reason):
        parse_json(raw)


def test_objects_and_other_values() -> None:
    assert parse_object(b'{"a": [1, 2.5, null]}\n') == {"a": [1, 2.5, None]}
    assert parse_json("[1]") == [1]
    with pytest.raises(BadLine, match="a list, not a JSON object"):
        parse_object("[1]")
    assert parse_json(b'{"loss": NaN}', nan=True)["loss"] != parse_json(b'{"loss": NaN}', nan=True)["loss"]
