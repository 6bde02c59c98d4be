"""lingctl.core.names: the one check every name read from data passes before it is joined to a path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lingctl.core.errors import EXIT_VERIFY
from lingctl.core.names import UnsafeNameError, check_relative, join_under, printable


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "dir/file.bin",
        "step-000100/state/.metadata",
        "ünï/日本語.txt",
        "with space & plus+",
        "..hidden",
        "a..b/c",
        ".lingctl-tmp-x",
    ],
)
def test_normal_names_are_accepted(tmp_path: Path, name: str) -> None:
    assert check_relative(name) == name
    joined = join_under(tmp_path, name)
    assert joined == tmp_path / name
    assert os.path.commonpath([tmp_path, joined]) == str(tmp_path)


@pytest.mark.parametrize(
    "name, reason",
    [
        ("/etc/passwd", "absolute"),
        ("\\windows", "absolute"),
        ("../escape", "segment"),
        ("a/../../escape", "segment"),
        ("a/./b", "segment"),
        ("a//b", "empty"),
        ("a/", "empty"),
        ("", "not a file name"),
        ("line\nbreak", "control characters"),
        ("esc\x1b[31mred", "control characters"),
        ("nul\x00byte", "control characters"),
        ("del\x7f", "control characters"),
        ("lone\ud800", "lone surrogate"),
        ("x" * 256, "too long"),
        ("a/" * 2100 + "b", "too long"),
    ],
)
def test_unsafe_names_are_refused_with_exit_4(tmp_path: Path, name: str, reason: str) -> None:
    with pytest.raises(UnsafeNameError, match=reason) as info:
        join_under(tmp_path, name, what="manifest entry")
    assert info.value.exit_code == EXIT_VERIFY
    assert "manifest entry" in info.value.message
    assert "\n" not in info.value.message and "\x1b" not in info.value.message  # shown escaped, one line


@pytest.mark.parametrize("value", [None, 3, b"bytes", ["a"]])
def test_non_strings_are_refused(value: object) -> None:
    with pytest.raises(UnsafeNameError, match="not a file name"):
        check_relative(value)


def test_printable_escapes_control_characters_and_keeps_the_rest() -> None:
    assert printable("plain name/ünï 日本語.txt") == "plain name/ünï 日本語.txt"
    shown = printable("evil\x1b[2J\x1b]0;title\x07\nFAKE LOG LINE\r\x7f\x9b")
    assert "\x1b" not in shown and "\n" not in shown and "\r" not in shown and "\x07" not in shown
    assert "\x7f" not in shown and "\x9b" not in shown
    assert shown == "evil\\x1b[2J\\x1b]0;title\\x07\\nFAKE LOG LINE\\r\\x7f\\x9b"
    assert printable("a\ud800b") == "a\\ud800b"
    # Invisible characters that reorder or break what follows them are shown too; joiners that scripts need stay.
    assert printable("evil\u202etxt.exe") == "evil\\u202etxt.exe"
    assert printable("a\u2066b\u2069c\u2028d\u200be") == "a\\u2066b\\u2069c\\u2028d\\u200be"
    assert printable("می\u200cخواهم") == "می\u200cخواهم"
    assert shown.isprintable()
