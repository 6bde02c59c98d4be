"""`lingctl flood run` with s3:// batch, output and errors, against the suite's real S3 server: the answers are
those of a local run, an earlier output is refused without --resume, a resume on another machine (no staged
copy) downloads what the store holds, and what an interrupted run wrote goes up and is resumed from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lingctl.core.errors import Interrupted, NotFoundError, UsageError
from lingctl.core.storage import S3Options, StoreURL, open_store
from lingctl.flood.batch.output import manifest_path
from lingctl.flood.batch.remote_io import STAGING, StagedOutputs
from tests.commands.test_flood import cli, greedy

pytestmark = pytest.mark.slow


def batch_bytes(n: int) -> bytes:
    return b"".join(json.dumps(greedy(f"r{i:02d}", [5 + i, 6, 7 + i], 4 + i % 3)).encode() + b"\n" for i in range(n))


def jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def texts(records: list[dict]) -> dict[str, list[int]]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in records}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lingctl's cache for this module (one, so flood's native kernels are compiled once)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def env(s3_env: dict[str, str], cache: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The S3 server's variables and the module's lingctl cache, here and for subprocesses; a fixed
    ``created`` time, so two runs of one batch give the same bytes."""
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(cache))
    return {**s3_env, "LINGCTL_CACHE_DIR": str(cache), "SOURCE_DATE_EPOCH": "1700000000"}


@pytest.fixture
def store(s3_bucket: str, env: dict[str, str]):
    return open_store(StoreURL("s3", s3_bucket), S3Options())


def test_s3_batch_output_and_errors_match_a_local_run(lingctl, tiny_ckpt, tmp_path, cache, env, store, s3_bucket):
    data = batch_bytes(4) + b"{not json\n"
    store.write("in/b.jsonl", data)
    (tmp_path / "b.jsonl").write_bytes(data)
    local = lingctl("flood", "run", str(tmp_path / "b.jsonl"), "-m", str(tiny_ckpt), env=env)
    assert local.returncode == 0, local.stderr
    res = lingctl(
        "flood",
        "run",
        f"s3://{s3_bucket}/in/b.jsonl",
        "-m",
        str(tiny_ckpt),
        "-o",
        f"s3://{s3_bucket}/out/o.jsonl",
        "--errors",
        f"s3://{s3_bucket}/out/e.jsonl",
        "--json",
        env=env,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["out"] == f"s3://{s3_bucket}/out/o.jsonl" and summary["errors"] == f"s3://{s3_bucket}/out/e.jsonl"
    out = jsonl(store.read("out/o.jsonl"))
    assert sorted(r["custom_id"] for r in out) == [f"r{i:02d}" for i in range(4)]
    assert texts(out) == texts(jsonl((tmp_path / "b.output.jsonl").read_bytes()))
    assert store.read("out/o.jsonl") == (tmp_path / "b.output.jsonl").read_bytes()  # the same file, ids included
    assert [e["error"]["code"] for e in jsonl(store.read("out/e.jsonl"))] == ["invalid_json"]
    assert json.loads(store.read("out/o.jsonl.manifest.json"))["written"]["output"]["bytes"] == len(
        store.read("out/o.jsonl")
    )
    # A complete run leaves no staged copy behind.
    assert not [p for p in (cache / STAGING).rglob("*") if p.is_file()]


def test_an_earlier_output_is_refused_without_resume_and_a_missing_batch_is_one_line(
    capsys, tiny_ckpt, env, store, s3_bucket
):
    store.write("b.jsonl", batch_bytes(1))
    store.write("b.output.jsonl", b'{"custom_id": "old"}\n')
    code, _, err = cli(capsys, "flood", "run", f"s3://{s3_bucket}/b.jsonl", "-m", str(tiny_ckpt))
    assert code == 2 and "Traceback" not in err
    assert f"s3://{s3_bucket}/b.output.jsonl already exists and is not empty" in err and "--resume" in err
    assert len(err.strip().splitlines()) <= 2  # the error and its hint
    assert store.read("b.output.jsonl") == b'{"custom_id": "old"}\n'
    assert not store.exists("b.errors.jsonl")

    code, _, err = cli(capsys, "flood", "run", f"s3://{s3_bucket}/nope.jsonl", "-m", str(tiny_ckpt))
    assert code == 3 and "Traceback" not in err
    assert err.startswith("lingctl: error: batch s3://") and len(err.strip().splitlines()) <= 2


def test_resume_without_a_staged_copy_downloads_the_output_and_manifest(
    lingctl, tiny_ckpt, cache, env, store, s3_bucket
):
    store.write("b.jsonl", batch_bytes(3))
    args = ["flood", "run", f"s3://{s3_bucket}/b.jsonl", "-m", str(tiny_ckpt), "-o", f"s3://{s3_bucket}/o.jsonl"]
    first = lingctl(*args, env=env)
    assert first.returncode == 0, first.stderr
    before = store.read("o.jsonl")
    store.write("b.jsonl", batch_bytes(7))  # more lines: the first three are answered
    shutil.rmtree(cache / STAGING)  # another machine: nothing staged
    res = lingctl(*args, "--resume", "--json", env=env)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["already_done"] == 3 and summary["succeeded"] == 4
    after = store.read("o.jsonl")
    assert after.startswith(before)
    assert sorted(r["custom_id"] for r in jsonl(after)) == [f"r{i:02d}" for i in range(7)]  # each exactly once
    assert store.exists("o.errors.jsonl")


def test_an_interrupted_run_uploads_what_it_wrote_and_its_staged_copy_is_resumed(env, store, s3_bucket):
    """The staging without the model: the block writes as a run would, then stops."""
    out, errors = f"s3://{s3_bucket}/o.jsonl", f"s3://{s3_bucket}/e.jsonl"
    staged = StagedOutputs("b.jsonl", out, errors, resume=False)
    staged_out, staged_errors = staged.out, staged.errors  # known before the block is entered
    assert staged_out is not None and staged_errors is not None
    with pytest.raises(Interrupted), staged:
        staged_out.write_bytes(b'{"custom_id": "a"}\n')
        staged_errors.write_bytes(b"")
        manifest_path(staged_out).write_text(json.dumps({"written": {"output": {"bytes": 19, "sha256": "0" * 64}}}))
        raise Interrupted("stopped")
    assert store.read("o.jsonl") == b'{"custom_id": "a"}\n' and store.exists("o.jsonl.manifest.json")
    assert staged_out.read_bytes() == b'{"custom_id": "a"}\n'  # kept for the resume
    # A fresh run refuses both what the store holds and the staged copy.
    store.delete("o.jsonl")
    store.delete("o.jsonl.manifest.json")
    with pytest.raises(UsageError, match="staged copy of an unfinished run"):
        StagedOutputs("b.jsonl", out, errors, resume=False).__enter__()
    # The store has nothing: the staged copy is resumed, and goes up at the end even if nothing changed.
    with StagedOutputs("b.jsonl", out, errors, resume=True) as again:
        assert again.out == staged_out and staged_out.read_bytes() == b'{"custom_id": "a"}\n'
    assert store.read("o.jsonl") == b'{"custom_id": "a"}\n'
    assert not staged_out.exists()  # complete: the staged copies are removed


def test_a_failed_upload_says_where_the_staged_copy_is(env, s3_bucket):
    staged = StagedOutputs("b.jsonl", "s3://no-such-bucket/o.jsonl", None, resume=False)
    staged_out = staged.out
    assert staged_out is not None
    with pytest.raises(NotFoundError) as err, staged:
        staged_out.write_bytes(b'{"custom_id": "a"}\n')
    assert err.value.message.startswith("could not upload s3://no-such-bucket/o.jsonl: ")
    assert err.value.hint is not None and str(staged_out) in err.value.hint and "--resume" in err.value.hint
    assert staged_out.read_bytes() == b'{"custom_id": "a"}\n'
