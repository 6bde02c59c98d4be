"""``--model s3://bucket/prefix`` against the suite's real S3 server: the copy in lingctl's cache equals the
checkpoint byte for byte and keeps its name, a second call copies nothing, a copy waits for another holding the
machine's lock, a run from the copy answers as a run from the local directory, and a missing prefix is one line."""

from __future__ import annotations

import fcntl
import os
import stat
import threading
from pathlib import Path

import pytest

from lingctl.core.storage import S3Options, StoreURL, open_store, parse_url
from lingctl.flood.weights.remote_model import CACHE, ModelCopy, fetch_model, flood_model_dir
from tests.commands.test_flood import cli, greedy, read_jsonl, write_batch

pytestmark = pytest.mark.slow


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def env(s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The S3 server's variables and a fresh lingctl cache, here and for subprocesses."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(cache))
    return {**s3_env, "LINGCTL_CACHE_DIR": str(cache)}


@pytest.fixture
def remote(tiny_ckpt: Path, s3_bucket: str, env: dict[str, str]) -> str:
    """The tiny checkpoint uploaded to ``s3://BUCKET/models/ckpt``."""
    store = open_store(StoreURL("s3", s3_bucket, "models/ckpt"), S3Options())
    for key, data in tree(tiny_ckpt).items():
        store.write(key, data)
    return f"s3://{s3_bucket}/models/ckpt"


def test_the_copy_equals_the_checkpoint_keeps_its_name_and_a_second_call_copies_nothing(tiny_ckpt, remote, env):
    local = flood_model_dir(remote)
    assert local.name == "ckpt"
    assert tree(local) == tree(tiny_ckpt)  # byte for byte, and nothing else: no journal inside
    root = Path(env["LINGCTL_CACHE_DIR"]) / CACHE
    assert local.parent.parent == root
    for directory in (root, local.parent):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    before = {p.name: p.stat().st_ino for p in local.iterdir()}

    again, result = fetch_model(parse_url(remote), S3Options())
    assert again == local
    assert (result.copied, result.copied_bytes, result.skipped) == (0, 0, len(before))
    assert result.verify_mode == "sampled" and not result.failed
    assert not Path(result.journal).is_relative_to(local)
    assert {p.name: p.stat().st_ino for p in local.iterdir()} == before  # the same files, not rewritten
    # A local directory still goes to resolve_model_dir unchanged.
    assert flood_model_dir(tiny_ckpt) == tiny_ckpt


def test_a_copy_waits_while_another_process_holds_the_machine_s_lock(tiny_ckpt, remote, env):
    copy = ModelCopy.of(parse_url(remote), S3Options())
    flood_model_dir(remote)  # creates the cache's directories and the lock file; then the copy is emptied
    for p in copy.path.iterdir():
        p.unlink()
    done: list[Path] = []
    fd = os.open(copy.lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a separate open file: conflicts even within this process
        worker = threading.Thread(target=lambda: done.append(flood_model_dir(remote)))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and list(copy.path.iterdir()) == []
    finally:
        os.close(fd)
    worker.join(20)
    assert done == [copy.path] and tree(copy.path) == tree(tiny_ckpt)


def test_a_run_from_s3_answers_as_the_local_directory_does(lingctl, tiny_ckpt, remote, env, tmp_path):
    # Requests that name no model: the answers' "model" is then the directory's name.
    lines = [{"custom_id": f"r{i}", "prompt": [5 + i, 6, 7], "max_tokens": 6, "temperature": 0} for i in range(3)]
    batch = write_batch(tmp_path / "b.jsonl", lines)
    answers = {}
    for name, model in (("local", str(tiny_ckpt)), ("s3", remote)):
        out = tmp_path / f"{name}.jsonl"
        res = lingctl("flood", "run", str(batch), "--model", model, "--threads", "1", "-o", str(out), env=env)
        assert res.returncode == 0, res.stderr
        answers[name] = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    assert answers["local"]["r0"]["model"] == "tiny" and answers["s3"]["r0"]["model"] == "ckpt"

    def texts(bodies: dict[str, dict]) -> dict[str, tuple[str, list[int]]]:
        return {k: (b["choices"][0]["text"], b["choices"][0]["token_ids"]) for k, b in bodies.items()}

    assert len(answers["s3"]) == 3 and texts(answers["s3"]) == texts(answers["local"])


def test_a_missing_prefix_is_one_line_and_exit_3(capsys, s3_bucket, env, tmp_path):
    batch = write_batch(tmp_path / "b.jsonl", [greedy("a", [5], 1)])
    missing = f"s3://{s3_bucket}/no/such/ckpt"
    code, out, err = cli(capsys, "flood", "run", str(batch), "--model", missing, "-o", str(tmp_path / "o.jsonl"))
    assert code == 3 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"lingctl: error: --model {missing}: no objects under this prefix"), err
    assert "Traceback" not in err and len(lines) <= 2  # the error and its hint
    assert not ModelCopy.of(parse_url(missing), S3Options()).path.exists()
