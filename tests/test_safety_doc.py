"""docs/safety.md names the test that holds each promise: every name it gives must be a test that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `tests/x.py::test_name` or, after one in the same row, `::other_test` (same file); `[param]` ids are dropped.
_REF = re.compile(r"`(tests/[^`:]+\.py)(?:::([A-Za-z_0-9]+)[^`]*)?`|`::([A-Za-z_0-9]+)[^`]*`")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_every_test_named_by_the_safety_page_exists() -> None:
    rows = [line for line in (ROOT / "docs/safety.md").read_text().splitlines() if line.startswith("| ")]
    named, missing = 0, []
    for row in rows:
        current: str | None = None
        for path, name, short in _REF.findall(row):
            if path:
                current = path
                if not (ROOT / path).is_file():
                    missing.append(path)
                    continue
            name = name or short
            if not name or current is None or not (ROOT / current).is_file():
                continue
            named += 1
            if name not in _tests_in(ROOT / current):
                missing.append(f"{current}::{name}")
    assert named > 50  # the pattern still finds the page's references
    assert missing == []
