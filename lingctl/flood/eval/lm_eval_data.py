"""The local data files of an lm-evaluation-harness task file, read into rows (one dict per document) by split.

lm-eval loads data with Hugging Face ``datasets.load_dataset(dataset_path, dataset_name, **dataset_kwargs)``.
Only its local-file builders are read here, with their ``data_files``:

- ``json``: JSON Lines (one object per line), or one JSON array of objects;
- ``csv``: a header row, then one row per document; a column whose every non-empty cell is an integer
  (else a number) holds integers (numbers), as pandas, which ``datasets`` reads CSV with, would infer; an empty
  cell is null;
- ``parquet``: through ``pyarrow`` when it is installed.

``data_files`` is a path, a list of paths (both are split ``train``, as in ``datasets``) or a split → path(s)
mapping. A relative path is relative to the directory of the task file that names it. As in ``datasets``, every row of a split
has every column: a key a row lacks is null there.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from lingctl.core.errors import UsageError, os_error
from lingctl.core.jsonl import BadLine, parse_json

BUILDERS = ("json", "csv", "parquet")
DEFAULT_SPLIT = "train"  # datasets' split for data_files given as a path or a list


def data_files(spec: Any, task_file: Path) -> dict[str, list[Path]]:
    """``dataset_kwargs.data_files`` as split → paths (those still relative: against the task file's directory)."""
    if isinstance(spec, (str, list)):
        spec = {DEFAULT_SPLIT: spec}
    if not isinstance(spec, dict) or not spec:
        raise UsageError(f"{task_file}: dataset_kwargs.data_files must be a path, a list of paths or split: path")
    out: dict[str, list[Path]] = {}
    for split, paths in spec.items():
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(split, str) or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise UsageError(f"{task_file}: dataset_kwargs.data_files.{split}: must be a path or a list of paths")
        out[split] = [(task_file.parent / p) for p in paths]
    return out


def read_rows(builder: str, path: Path, task_file: Path) -> tuple[list[dict[str, Any]], bytes]:
    """The rows of one data file, and its bytes (for the task's sha256)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(
            f"{task_file}: data file {path} does not exist", hint="a relative path is relative to the task file"
        ) from None
    except OSError as exc:
        raise os_error(exc, str(path)) from None
    if builder == "json":
        rows = _json_rows(data, path)
    elif builder == "csv":
        rows = _csv_rows(data, path)
    else:
        rows = _parquet_rows(path)
    return rows, data


def fill_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Give every row every column of the split (null where it lacks one), as a ``datasets`` split has; the
    columns, in first-seen order."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    for row in rows:
        for name in columns:
            row.setdefault(name, None)
    return list(columns)


def _json_rows(data: bytes, path: Path) -> list[dict[str, Any]]:
    if data.lstrip()[:1] == b"[":  # one JSON array of objects
        try:
            rows = parse_json(data)
        except BadLine as exc:
            raise UsageError(f"{path}: {exc}") from None
        numbered = list(enumerate(rows, start=1))
    else:
        numbered = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            if raw.strip():
                try:
                    numbered.append((number, parse_json(raw)))
                except BadLine as exc:
                    raise UsageError(f"{path}:{number}: not a JSON object ({exc})") from None
    for number, row in numbered:
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{number}: not a JSON object")
    return [row for _, row in numbered]


def _csv_rows(data: bytes, path: Path) -> list[dict[str, Any]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text ({exc})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        rows: list[dict[str, Any]] = [dict(r) for r in reader]
    except csv.Error as exc:
        raise UsageError(f"{path}:{reader.line_num}: not CSV ({exc})") from None
    for number, row in enumerate(rows, start=2):
        if None in row or None in row.values():
            raise UsageError(f"{path}: row {number} does not have as many cells as the header")
    for name in reader.fieldnames or []:
        cells = [r[name] for r in rows if r[name] != ""]
        kind = next((k for k in (int, float) if all(_parses(k, c) for c in cells)), str) if cells else str
        for r in rows:
            r[name] = None if r[name] == "" else kind(r[name])
    return rows


def _parses(kind: type, cell: str) -> bool:
    if "_" in cell:  # Python reads 1_000 as a number; pandas does not
        return False
    try:
        kind(cell)
    except ValueError:
        return False
    return True


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise UsageError(
            f"{path}: reading parquet needs pyarrow, which is not installed",
            hint="pip install pyarrow, or convert the file to JSON Lines and write dataset_path: json",
        ) from None
    try:
        return list(pq.read_table(path).to_pylist())
    except Exception as exc:  # pyarrow's own errors: a damaged or non-parquet file
        raise UsageError(f"{path}: not a parquet file pyarrow can read ({type(exc).__name__}: {exc})") from None
