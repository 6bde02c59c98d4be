"""The flash tier against real files, a real shared directory and a real S3 server (rclone serve s3)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lingctl.babel.verify import verify as babel_verify
from lingctl.commands.pcache import status as status_cmd
from lingctl.commands.pcache import upload as upload_cmd
from lingctl.core.errors import LingctlError, RetryableError, VerificationError
from lingctl.core.storage import S3Options, open_store, parse_url
from lingctl.pcache.local_copy import fetch, resolve_for_read
from lingctl.pcache.marker import MARKER, verify_local
from lingctl.pcache.tier import Uploader, upload
from lingctl.pcache.tier_status import status
from tests.pcache.tier_fixtures import flip_byte, make_checkpoint, split_node


def one(path: Path, remote: str | None = None):
    rows = status(path, remote)
    assert len(rows) == 1, rows
    return rows[0]


def cli_app() -> typer.Typer:
    """The two commands as the pcache group will hold them."""
    app = typer.Typer()
    app.command("status")(status_cmd)
    app.command("upload")(upload_cmd)
    return app


@pytest.fixture(scope="module")
def cli_registered() -> bool:
    from tests.conftest import run_lingctl

    return run_lingctl("pcache", "status", "--help").returncode == 0


# -- local only ---------------------------------------------------------------------------------------------


def test_verify_local_full_and_sampled(tmp_path):
    d = tmp_path / "step-1"
    make_checkpoint(d, sizes=[9 << 20, 5_000])  # rank 0's file is above the sampled CRC limit (8 MiB)
    assert verify_local(d) == []
    flip_byte(d / "__0_0.distcp", offset=5 << 20)
    assert verify_local(d, mode="sampled") == []  # sizes only for large files: documented
    assert "__0_0.distcp: checksum" in verify_local(d, mode="full")[0]
    flip_byte(d / "__1_0.distcp")
    assert any(p.startswith("__1_0.distcp: checksum") for p in verify_local(d, mode="sampled"))
    (d / "__1.pcache.json").unlink()
    assert "__1.pcache.json: missing" in verify_local(d, mode="none")
    (d / MARKER).unlink()
    assert "incomplete" in verify_local(d)[0]


def test_status_incomplete_local_only_and_discovery(tmp_path):
    cache = tmp_path / "cache"
    make_checkpoint(cache / "run" / "step-1")
    make_checkpoint(cache / "run" / "step-2", marker=False)
    (cache / "run" / "step-2" / ".__0_0.distcp.lingctl-tmp-x").write_bytes(b"half")  # ignored
    make_checkpoint(cache / "other" / "a" / "b" / "too-deep")
    rows = {r.name: r for r in status(cache)}
    assert set(rows) == {"run/step-1", "run/step-2"}
    assert rows["run/step-1"].state == "local-only" and rows["run/step-1"].remote is None
    assert rows["run/step-2"].state == "incomplete"
    assert rows["run/step-2"].files == 5 and rows["run/step-1"].files == 6
    single = one(cache / "run" / "step-1", str(tmp_path / "shared"))
    assert (single.name, single.state, single.uploaded_bytes) == ("step-1", "local-only", 0)


def test_upload_to_shared_path(tmp_path):
    d, shared = tmp_path / "cache" / "step-1", tmp_path / "shared" / "step-1"
    files = make_checkpoint(d, ranks=3, sizes=[30_000, None, 20_000])  # rank 1 wrote no data file
    r = upload(d, str(shared))
    assert r.finalized and r.copied == len(files)
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == files  # no journal or notes inside
    st = one(d)
    assert (st.state, st.remote, st.uploaded_bytes) == ("durable", str(shared), st.bytes)
    assert upload(d, str(shared)).copied == 0
    assert resolve_for_read(str(shared), cache_dir=None) == shared


def test_upload_refuses_damaged_local_copy_and_incomplete_dirs(tmp_path):
    d, shared = tmp_path / "step-1", tmp_path / "shared"
    make_checkpoint(d)
    flip_byte(d / "__1_0.distcp")
    with pytest.raises(VerificationError, match="__1_0.distcp: checksum"):
        upload(d, str(shared), rank=1, finalize=False)
    assert not (shared / "__1_0.distcp").exists()
    assert one(d, str(shared)).state == "upload-failed"
    (d / MARKER).unlink()
    with pytest.raises(VerificationError, match="incomplete"):
        resolve_for_read(str(d), cache_dir=None)


def test_uploader_reports_errors_and_durable_callbacks(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_checkpoint(good)
    make_checkpoint(bad, marker=False)
    durable: list[str] = []
    with Uploader() as up:
        up.submit(good, str(tmp_path / "shared" / "good"), on_durable=durable.append)
        up.submit(bad, str(tmp_path / "shared" / "bad"))
        with pytest.raises(VerificationError, match="incomplete checkpoint"):
            up.wait(timeout=30)
        assert durable == [str(tmp_path / "shared" / "good")] and up.pending() == 0
        assert one(bad).state == "incomplete"  # refused before anything was recorded
        up.submit(good, str(tmp_path / "shared" / "good"))
        [result] = up.wait(timeout=30)
        assert result.copied == 0 and result.finalized
    with pytest.raises(LingctlError, match="closed"):
        up.submit(good, str(tmp_path / "x"))


def test_cli_status_and_upload_in_process(tmp_path):
    d, shared = tmp_path / "cache" / "step-1", tmp_path / "shared" / "step-1"
    make_checkpoint(d)
    runner = CliRunner()
    res = runner.invoke(cli_app(), ["status", str(tmp_path / "cache"), "--json"])
    assert res.exit_code == 0, res.output
    assert [(r["name"], r["state"]) for r in json.loads(res.stdout)["checkpoints"]] == [("step-1", "local-only")]
    res = runner.invoke(cli_app(), ["upload", str(d)])
    assert isinstance(res.exception, LingctlError) and res.exception.hint is not None and "--to" in res.exception.hint
    res = runner.invoke(cli_app(), ["upload", str(d), "--to", str(shared), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["finalized"] is True
    (shared / "__0_0.distcp").unlink()
    res = runner.invoke(cli_app(), ["status", str(d)])
    assert res.exit_code == 1 and "upload-failed" in res.stdout and "__0_0.distcp: missing" in res.stdout
    res = runner.invoke(cli_app(), ["upload", str(d), "--json"])  # the recorded destination
    assert res.exit_code == 0 and json.loads(res.stdout)["copied"] == 1


# -- S3 -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_upload_to_s3_is_durable_and_verifies(tmp_path, s3_bucket):
    d = tmp_path / "cache" / "step-1"
    files = make_checkpoint(d, ranks=2)
    url = f"s3://{s3_bucket}/run/step-1"
    r = upload(d, url)
    assert r.finalized and r.copied == len(files) and r.copied_bytes == sum(map(len, files.values()))
    st = one(d)
    assert (st.state, st.remote, st.problems) == ("durable", url, [])
    diff = babel_verify(parse_url(str(d)), parse_url(url), S3Options(), mode="full")
    assert diff.ok and diff.checked == len(files), diff.differences


@pytest.mark.slow
def test_ranks_upload_then_coordinator_finalizes(tmp_path, s3_bucket):
    node_a, node_b = tmp_path / "a" / "step-1", tmp_path / "b" / "step-1"
    make_checkpoint(node_a, ranks=2)
    split_node(node_a, node_b, ranks=[1])  # node B holds only rank 1's files, node A the rest
    url = f"s3://{s3_bucket}/step-1"
    store = open_store(url)
    durable: list[str] = []
    with Uploader() as up:
        up.submit(node_a, url, rank=0, finalize=True, timeout_s=30, on_durable=durable.append)
        deadline = time.monotonic() + 20
        while not store.exists("__0.pcache.json") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the coordinator is now polling for rank 1's files
        assert up.pending() == 1 and not store.exists(MARKER) and not store.exists(".metadata")
        assert one(node_a).state == "uploading"
        upload(node_b, url, rank=1, finalize=False)
        [result] = up.wait(timeout=30)
    assert durable == [url] and result.waited_s > 0
    assert store.exists(MARKER)
    assert one(node_a).state == "durable" and one(node_b).state == "durable"


@pytest.mark.slow
def test_marker_is_uploaded_last(tmp_path, s3_bucket):
    node_a, node_b = tmp_path / "a" / "step-1", tmp_path / "b" / "step-1"
    make_checkpoint(node_a, ranks=2)
    split_node(node_a, node_b, ranks=[1])
    url = f"s3://{s3_bucket}/step-1"
    with pytest.raises(RetryableError, match=r"timed out .* waiting for 2 file\(s\).*__1.*pcache.json was not"):
        upload(node_a, url, rank=0, timeout_s=0.3)
    keys = {i.key for i in open_store(url).list()}
    assert keys == {"__0_0.distcp", "__0.pcache.json"}  # neither .metadata nor the marker
    st = one(node_a)
    assert st.state == "upload-failed" and "timed out" in st.problems[0]


@pytest.mark.slow
def test_interrupted_upload_resumes(tmp_path, s3_bucket):
    d = tmp_path / "step-1"
    files = make_checkpoint(d, ranks=2)
    url = f"s3://{s3_bucket}/step-1"
    upload(d, url, verify="sampled")
    open_store(url).delete("__1_0.distcp")
    st = one(d)
    assert st.state == "upload-failed" and "__1_0.distcp: missing at the remote" in st.problems
    r = upload(d, url)
    assert (r.copied, r.copied_bytes, r.skipped) == (1, len(files["__1_0.distcp"]), len(files) - 1)
    assert one(d).state == "durable"


@pytest.mark.slow
def test_resolve_for_read_prefers_verified_local_copy(tmp_path, s3_bucket, caplog):
    cache = tmp_path / "cache"
    d = cache / s3_bucket / "run" / "step-1"
    files = make_checkpoint(d, ranks=2)
    url = f"s3://{s3_bucket}/run/step-1"
    upload(d, url)
    inodes = {p.name: p.stat().st_ino for p in d.iterdir()}
    with caplog.at_level(logging.INFO, logger="lingctl.pcache.tier"):
        assert resolve_for_read(url, cache_dir=cache) == d
    assert "from its local copy" in caplog.text
    flip_byte(d / "__1_0.distcp")
    assert resolve_for_read(url, cache_dir=cache) == d
    assert verify_local(d) == [] and (d / "__1_0.distcp").read_bytes() == files["__1_0.distcp"]
    after = {p.name: p.stat().st_ino for p in d.iterdir()}
    assert {n for n in inodes if after[n] != inodes[n]} == {"__1_0.distcp", MARKER}  # only it was fetched
    other = tmp_path / "elsewhere"
    assert fetch(url, other) == other and verify_local(other) == []
    exact = tmp_path / "exact"
    assert resolve_for_read(url, cache_dir=exact, exact=True) == exact and verify_local(exact) == []


@pytest.mark.slow
def test_cli_subprocess(tmp_path, s3_bucket, s3_env, lingctl, cli_registered):
    if not cli_registered:
        pytest.skip("'lingctl pcache status' is not registered in lingctl/cli.py yet")
    d = tmp_path / "step-1"
    make_checkpoint(d)
    url = f"s3://{s3_bucket}/step-1"
    res = lingctl("pcache", "upload", str(d), "--to", url, "--json", env=s3_env)
    assert res.returncode == 0, res.stderr
    res = lingctl("pcache", "status", str(d), "--json", env=s3_env)
    assert res.returncode == 0, res.stderr
    assert [r["state"] for r in json.loads(res.stdout)["checkpoints"]] == ["durable"]


def test_uploader_wait_timeout(tmp_path):
    d = tmp_path / "step-1"
    make_checkpoint(d, ranks=2)
    split_node(d, tmp_path / "elsewhere", ranks=[1])
    up = Uploader()
    up.submit(d, str(tmp_path / "shared"), rank=0, timeout_s=0.3)
    with pytest.raises(LingctlError, match="still running"):
        up.wait(timeout=0.01)
    with pytest.raises(RetryableError, match="timed out"):
        up.wait(timeout=30)
    up.close()
