"""Training data: source files → documents → token rows → a resumable order of batches.

The pipeline is deterministic end to end (file order, train/eval split, packing, batch order), so a
resumed run sees exactly the batches it would have seen without the interruption.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lingctl.core.errors import LingctlError, NotFoundError, UsageError, os_error
from lingctl.core.jsonl import BadLine, parse_json

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

GLOB_CHARS = frozenset("*?[")
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
# How much of a file is checked for NUL bytes; the same heuristic as git's binary detection.
BINARY_SNIFF_BYTES = 8192
# Documents per tokenizer call: large enough for encode_batch's threads to pay off, small enough to stream.
ENCODE_CHUNK = 256


def default_corpus_files() -> list[Path]:
    """The standard library's own ``.py`` files: a corpus every Python install has, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                if path.is_file():
                    found.append((path.relative_to(root).as_posix(), path))
    # os.walk order depends on the file system; sorting on the relative path makes it the same everywhere.
    return [path for _, path in sorted(found)]


def _walk_dir(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                yield path


def resolve_sources(paths: Sequence[str]) -> list[Path]:
    """Files named by ``paths`` (files, directories walked recursively, or glob patterns), sorted, no repeats."""
    files: set[Path] = set()
    for entry in paths:
        if GLOB_CHARS.intersection(entry):
            matches = [Path(m) for m in glob.glob(os.path.expanduser(entry), recursive=True)]
            if not matches:
                raise NotFoundError(f"data path not found: {entry}", hint="the pattern matched no files")
        else:
            path = Path(entry).expanduser()
            if not path.exists():
                raise NotFoundError(f"data path not found: {entry}")
            matches = [path]
        for match in matches:
            # Absolute so the same file named two ways counts once, and doc ids do not depend on the cwd.
            match = Path(os.path.abspath(match))
            if match.is_dir():
                files.update(_walk_dir(match))
            elif match.is_file():
                files.add(match)
    if not files:
        raise UsageError(
            "no data files found in: " + ", ".join(paths),
            hint="point at text or .jsonl files, or at directories that hold them",
        )
    return sorted(files)


def _truncate_utf8(text: str, limit: int) -> str:
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")


def iter_json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """``(FILE:LINE, value)`` for each non-blank line of a JSONL file; a malformed line is one error naming it."""
    try:
        with path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", parse_json(line)
                except BadLine as exc:
                    raise LingctlError(f"{path}:{lineno}: malformed JSON: {exc}") from None
    except OSError as exc:
        raise os_error(exc, str(path)) from exc


def _iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    for where, record in iter_json_lines(path):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise LingctlError(
                f"{where}: no string field {text_field!r}",
                hint=f"each line must be a JSON object with the document in {text_field!r}",
            )
        yield where, text


def _read_text(path: Path, limit: int | None) -> str | None:
    """The file as text, at most ``limit`` bytes read, or ``None`` for a binary file."""
    try:
        with path.open("rb") as f:
            raw = f.read() if limit is None else f.read(limit)
    except OSError as exc:
        raise os_error(exc, str(path)) from exc
    if b"\0" in raw[:BINARY_SNIFF_BYTES]:
        log.warning("skipping binary file %s", path)
        return None
    return raw.decode("utf-8", errors="replace")


def iter_documents(
    files: Iterable[Path], *, text_field: str = "text", max_bytes: int | None = None
) -> Iterator[tuple[str, str]]:
    """``(doc_id, text)`` for each document: one per line of a ``.jsonl`` file, one per other file.

    ``max_bytes`` caps the UTF-8 size of all the text yielded; the document that reaches it is cut short.
    Empty documents are skipped: they would only add end-of-text tokens.
    """
    budget = max_bytes
    for path in files:
        path = Path(path)
        if budget is not None and budget <= 0:
            return
        if path.suffix == ".jsonl":
            docs: Iterable[tuple[str, str]] = _iter_jsonl(path, text_field)
        else:
            text = _read_text(path, budget)
            docs = [] if text is None else [(str(path), text)]
        for doc_id, text in docs:
            if budget is not None:
                size = len(text.encode("utf-8"))
                if size >= budget:
                    text = _truncate_utf8(text, budget)
                budget -= min(size, budget)
            if text:
                yield doc_id, text
            if budget is not None and budget <= 0:
                return


def corpus_fingerprint(files: Iterable[Path]) -> str:
    """A short digest of the files' paths, sizes and modification times: changes when the data changes."""
    digest = hashlib.sha256()
    for path in files:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise os_error(exc, str(path)) from exc
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", errors="surrogateescape"))
    return digest.hexdigest()[:16]


@dataclass(kw_only=True, slots=True)
class TokenData:
    """Packed token rows. Each row holds ``seq_len + 1`` tokens: inputs are ``row[:-1]``, targets ``row[1:]``."""

    train: np.ndarray  # int32 [N, seq_len + 1]
    eval: np.ndarray  # int32 [M, seq_len + 1]; M is 0 when no eval split was asked for
    seq_len: int
    n_tokens: int  # tokens in both splits, end-of-text tokens included, before packing drops the tails
    n_documents: int


def is_eval_doc(doc_id: str, eval_fraction: float) -> bool:
    """Whether ``doc_id`` belongs to the eval split; a hash, so the answer never depends on document order."""
    h = int(hashlib.sha1(doc_id.encode("utf-8", errors="surrogateescape")).hexdigest()[:8], 16)
    return h / 2**32 < eval_fraction


def pack_rows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows of ``seq_len + 1`` tokens starting every ``seq_len``: each row's last token is the next row's first,
    so every token after the first is a target exactly once. The tail that does not fill a row is dropped."""
    n_rows = (len(tokens) - 1) // seq_len if len(tokens) > seq_len else 0
    if n_rows == 0:
        return np.empty((0, seq_len + 1), dtype=np.int32)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)
    return np.ascontiguousarray(windows[: n_rows * seq_len : seq_len], dtype=np.int32)


def build_token_data(
    documents: Iterable[tuple[str, str]], tok: Tokenizer, *, seq_len: int, eval_fraction: float, eos: int
) -> TokenData:
    """Tokenize ``documents``, split them into train and eval by doc id, and pack each split into rows."""
    if seq_len < 1:
        raise UsageError(f"seq_len must be at least 1, got {seq_len}")
    if not 0.0 <= eval_fraction < 1.0:
        raise UsageError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    eos_arr = np.array([eos], dtype=np.int32)
    n_documents = 0

    def flush(chunk: list[tuple[str, str]]) -> None:
        encodings = tok.encode_batch([text for _, text in chunk], add_special_tokens=False)
        for (doc_id, _), enc in zip(chunk, encodings):
            split = parts[is_eval_doc(doc_id, eval_fraction)]
            split.append(np.asarray(enc.ids, dtype=np.int32))
            split.append(eos_arr)

    chunk: list[tuple[str, str]] = []
    for doc in documents:
        chunk.append(doc)
        n_documents += 1
        if len(chunk) >= ENCODE_CHUNK:
            flush(chunk)
            chunk = []
    if chunk:
        flush(chunk)

    def concat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int32)

    train_tokens, eval_tokens = concat(parts[False]), concat(parts[True])
    train, eval_rows = pack_rows(train_tokens, seq_len), pack_rows(eval_tokens, seq_len)
    too_small = LingctlError(
        f"the corpus is too small for seq_len {seq_len}: {len(train_tokens)} train tokens in {n_documents} documents",
        hint="add data or lower seq_len",
    )
    if len(train) == 0:
        raise too_small
    if eval_fraction > 0 and len(eval_rows) == 0:
        # Too few eval documents to fill a row: borrow the end of train rather than evaluate on nothing.
        take = max(1, round(eval_fraction * len(train)))
        if take >= len(train):
            raise too_small
        log.info("eval split has fewer than %d tokens; using the last %d train row(s) for eval", seq_len + 1, take)
        train, eval_rows = train[:-take], train[-take:]
    return TokenData(
        train=train,
        eval=eval_rows,
        seq_len=seq_len,
        n_tokens=len(train_tokens) + len(eval_tokens),
        n_documents=n_documents,
    )


class Order(Protocol):
    """Which row comes at each position of a run's batch order (``BatchOrder``, a curriculum's ``StagedOrder``)."""

    n_rows: int

    def indices(self, cursor: int, count: int) -> np.ndarray: ...


class BatchOrder:
    """Which train row comes at each global sequence position: a fresh permutation per epoch.

    Position ``p`` is row ``perm(p // n_rows)[p % n_rows]`` with ``perm(e)`` seeded by ``(seed, e)``, so the
    order is a pure function of the seed and the position: resuming only needs the cursor.
    """

    def __init__(self, n_rows: int, seed: int) -> None:
        if n_rows < 1:
            raise ValueError(f"BatchOrder needs at least one row, got n_rows={n_rows}")
        if seed < 0:
            raise ValueError(f"BatchOrder seed must be non-negative, got seed={seed}")
        self.n_rows = n_rows
        self.seed = seed
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
            self._epoch = epoch
        return self._perm

    def indices(self, cursor: int, count: int) -> np.ndarray:
        """Row indices for positions ``cursor .. cursor + count - 1``; may span an epoch boundary."""
        if cursor < 0 or count < 0:
            raise ValueError(f"cursor and count must be non-negative, got cursor={cursor}, count={count}")
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            pos = cursor + done
            epoch, offset = divmod(pos, self.n_rows)
            take = min(self.n_rows - offset, count - done)
            out[done : done + take] = self._permutation(epoch)[offset : offset + take]
            done += take
        return out


def batch_tensors(data: np.ndarray, rows: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` as int64 tensors ``[B, seq_len]`` for the given rows of ``data``."""
    import torch  # deferred: listing and tokenizing data should not pay for importing torch

    batch = torch.from_numpy(data[rows].astype(np.int64))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
