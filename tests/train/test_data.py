from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from lingctl.core.errors import LingctlError, NotFoundError, UsageError
from lingctl.model.tokenizer import SPECIAL_EOS, eos_id, load_tokenizer, save_tokenizer, train_tokenizer
from lingctl.train.data import (
    BatchOrder,
    batch_tensors,
    build_token_data,
    corpus_fingerprint,
    default_corpus_files,
    is_eval_doc,
    iter_documents,
    resolve_sources,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Grüße aus Köln — naïve café, 東京, ünïcödé.\n",
    "for i in range(10):\n    print(i * i)\n" * 3,
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS * 4, vocab_size=400)


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


# --- sources ---------------------------------------------------------------------------------------------


def test_resolve_file_directory_and_glob(tmp_path: Path) -> None:
    a = write(tmp_path / "a.txt", "a")
    b = write(tmp_path / "d" / "sub" / "b.txt", "b")
    c = write(tmp_path / "d" / "c.jsonl", "{}")
    write(tmp_path / "d" / ".hidden", "x")
    write(tmp_path / "d" / ".git" / "config", "x")
    write(tmp_path / "d" / "__pycache__" / "m.pyc", b"x")
    assert resolve_sources([str(a)]) == [a]
    assert resolve_sources([str(tmp_path / "d")]) == sorted([b, c])
    assert resolve_sources([str(tmp_path / "**" / "*.txt")]) == sorted([a, b])
    # Overlapping entries name each file once.
    assert resolve_sources([str(a), str(tmp_path / "*.txt"), str(tmp_path)]) == sorted([a, b, c])


def test_resolve_missing_path_and_empty_glob(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(NotFoundError, match="data path not found") as info:
        resolve_sources([missing])
    assert missing in str(info.value)
    pattern = str(tmp_path / "*.none")
    with pytest.raises(NotFoundError) as info:
        resolve_sources([pattern])
    assert pattern in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError):
        resolve_sources([str(tmp_path / "empty")])


# --- documents -------------------------------------------------------------------------------------------


def test_jsonl_one_document_per_line(tmp_path: Path) -> None:
    f = write(tmp_path / "d.jsonl", '{"text": "one"}\n\n{"text": "two", "body": "b"}\n  \n')
    assert list(iter_documents([f])) == [(f"{f}:1", "one"), (f"{f}:3", "two")]
    with pytest.raises(LingctlError, match=f"{f}:1"):
        list(iter_documents([f], text_field="body"))


def test_jsonl_bad_line_and_missing_field(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": \n')
    with pytest.raises(LingctlError, match=f"{bad}:2") as info:
        list(iter_documents([bad]))
    assert "\n" not in str(info.value)
    missing = write(tmp_path / "missing.jsonl", '{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(LingctlError, match=f"{missing}:2: no string field 'text'"):
        list(iter_documents([missing]))
    not_str = write(tmp_path / "num.jsonl", '{"text": 3}\n')
    with pytest.raises(LingctlError, match=f"{not_str}:1"):
        list(iter_documents([not_str]))


def test_plain_files_binary_skipped_and_bad_utf8_replaced(tmp_path: Path, caplog) -> None:
    text = write(tmp_path / "a.txt", "hello\n")
    binary = write(tmp_path / "b.bin", b"\x7fELF\x00\x01\x02")
    latin1 = write(tmp_path / "c.txt", "café".encode("latin-1"))
    with caplog.at_level("WARNING", logger="lingctl.train.data"):
        docs = list(iter_documents([text, binary, latin1]))
    assert docs == [(str(text), "hello\n"), (str(latin1), "caf\ufffd")]
    assert str(binary) in caplog.text


def test_max_bytes_caps_total(tmp_path: Path) -> None:
    files = [write(tmp_path / f"{i}.txt", "x" * 100) for i in range(5)]
    docs = list(iter_documents(files, max_bytes=250))
    assert [len(t) for _, t in docs] == [100, 100, 50]
    jsonl = write(tmp_path / "d.jsonl", "".join(json.dumps({"text": "é" * 10}) + "\n" for _ in range(3)))
    docs = list(iter_documents([jsonl], max_bytes=25))
    assert sum(len(t.encode()) for _, t in docs) <= 25 and len(docs) == 2


def test_default_corpus_files() -> None:
    files = default_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and rel == sorted(rel)
    assert "os.py" in rel and "json/__init__.py" in rel
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "dist-packages", "__pycache__") for r in rel for part in r.split("/"))
    docs = list(iter_documents(files, max_bytes=200_000))
    assert 0 < sum(len(t.encode()) for _, t in docs) <= 200_000


def test_fingerprint_changes_with_data(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "one")
    before = corpus_fingerprint([f])
    assert corpus_fingerprint([f]) == before and len(before) == 16
    write(f, "one more")
    assert corpus_fingerprint([f]) != before


# --- tokenizer -------------------------------------------------------------------------------------------


def test_tokenizer_deterministic_and_round_trips(tok) -> None:
    assert train_tokenizer(TEXTS * 4, vocab_size=400).to_str() == tok.to_str()
    assert tok.get_vocab_size() <= 400
    for s in ["def f(x):\n    return x  # ok", "Grüße, 東京! ünseen ЖЯ 🙂", "\t\r\n  trailing "]:
        assert tok.decode(tok.encode(s, add_special_tokens=False).ids) == s
    assert eos_id(tok) == tok.token_to_id(SPECIAL_EOS)


def test_tokenizer_rejects_small_vocab() -> None:
    with pytest.raises(UsageError, match="299"):
        train_tokenizer(TEXTS, vocab_size=299)


def test_tokenizer_save_load(tok, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "tokenizer.json"
    save_tokenizer(tok, path)
    assert load_tokenizer(path).to_str() == tok.to_str()
    with pytest.raises(NotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    broken = write(tmp_path / "broken.json", '{"model": 1}')
    with pytest.raises(LingctlError, match="broken.json") as info:
        load_tokenizer(broken)
    assert "\n" not in str(info.value)


def test_eos_id_missing() -> None:
    from tokenizers import Tokenizer, models

    with pytest.raises(LingctlError, match="end-of-text"):
        eos_id(Tokenizer(models.BPE()))


# --- packing ---------------------------------------------------------------------------------------------


def make_docs(n: int) -> list[tuple[str, str]]:
    return [(f"doc-{i}", TEXTS[i % len(TEXTS)]) for i in range(n)]


def test_build_token_data_packing(tok) -> None:
    eos = eos_id(tok)
    data = build_token_data(make_docs(200), tok, seq_len=16, eval_fraction=0.1, eos=eos)
    assert data.train.dtype == np.int32 and data.eval.dtype == np.int32
    assert data.train.shape[1] == data.eval.shape[1] == 17 and data.seq_len == 16
    assert len(data.train) > 0 and len(data.eval) > 0 and data.n_documents == 200
    assert (data.train[:-1, -1] == data.train[1:, 0]).all()
    assert (data.eval[:-1, -1] == data.eval[1:, 0]).all()
    # Rows are a tiling of the token stream with a one-token overlap; only the tails are dropped.
    assert (len(data.train) + len(data.eval)) * 16 <= data.n_tokens
    assert data.n_tokens - (len(data.train) + len(data.eval)) * 16 <= 2 * 17

    # Tokens are the documents' encodings with eos after each, in order.
    train_docs = [t for d, t in make_docs(200) if not is_eval_doc(d, 0.1)]
    expected = []
    for t in train_docs:
        expected += tok.encode(t, add_special_tokens=False).ids + [eos]
    stream = np.concatenate([data.train[0], *(row[1:] for row in data.train[1:])])
    assert stream.tolist() == expected[: len(stream)]
    assert (data.train == eos).sum() >= 1


def test_eval_split_is_stable_and_disjoint(tok) -> None:
    docs = make_docs(200)
    split = [is_eval_doc(d, 0.2) for d, _ in docs]
    assert split == [is_eval_doc(d, 0.2) for d, _ in reversed(docs)][::-1]
    assert 0 < sum(split) < len(docs)
    a = build_token_data(docs, tok, seq_len=8, eval_fraction=0.2, eos=eos_id(tok))
    b = build_token_data(iter(docs), tok, seq_len=8, eval_fraction=0.2, eos=eos_id(tok))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.eval, b.eval)
    none = build_token_data(docs, tok, seq_len=8, eval_fraction=0.0, eos=eos_id(tok))
    assert none.eval.shape == (0, 9) and len(none.train) > len(a.train)


def test_eval_borrows_train_rows_when_eval_split_is_empty(tok) -> None:
    # A single document always lands in one split; with a tiny fraction that is train.
    docs = [("only", TEXTS[1] * 4)]
    assert not is_eval_doc("only", 0.01)
    full = build_token_data(docs, tok, seq_len=8, eval_fraction=0.0, eos=eos_id(tok))
    data = build_token_data(docs, tok, seq_len=8, eval_fraction=0.01, eos=eos_id(tok))
    assert len(data.eval) == 1 and len(data.train) == len(full.train) - 1
    assert np.array_equal(np.concatenate([data.train, data.eval]), full.train)


def test_too_small_corpus(tok) -> None:
    with pytest.raises(LingctlError, match="too small for seq_len 4096"):
        build_token_data([("a", "tiny")], tok, seq_len=4096, eval_fraction=0.0, eos=eos_id(tok))
    with pytest.raises(UsageError):
        build_token_data([("a", "tiny")], tok, seq_len=8, eval_fraction=1.0, eos=eos_id(tok))


# --- batch order -----------------------------------------------------------------------------------------


def test_batch_order_covers_every_row_once_per_epoch() -> None:
    order = BatchOrder(10, seed=3)
    for epoch in range(3):
        assert sorted(order.indices(epoch * 10, 10).tolist()) == list(range(10))
    assert not np.array_equal(order.indices(0, 10), order.indices(10, 10))


def test_batch_order_is_a_pure_function_of_seed_and_cursor() -> None:
    order = BatchOrder(7, seed=1)
    whole = order.indices(0, 10)
    assert np.array_equal(whole, np.concatenate([order.indices(0, 4), order.indices(4, 6)]))
    # Straddling the epoch boundary, asked out of order, from a fresh instance.
    assert np.array_equal(BatchOrder(7, seed=1).indices(5, 5), whole[5:])
    assert np.array_equal(BatchOrder(7, seed=1).indices(100, 3), order.indices(100, 3))
    assert not np.array_equal(BatchOrder(7, seed=2).indices(0, 14), order.indices(0, 14))
    assert order.indices(3, 0).shape == (0,)


def test_batch_tensors() -> None:
    data = np.arange(30, dtype=np.int32).reshape(3, 10)
    x, y = batch_tensors(data, np.array([2, 0]))
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (2, 9)
    assert x[0].tolist() == list(range(20, 29)) and y[1].tolist() == list(range(1, 10))
