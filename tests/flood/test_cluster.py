"""``flood run --ray`` on a real Ray cluster of three nodes on this machine (a head without CPUs, two nodes of one
CPU each, started by Ray's own ``cluster_utils``): the output is the local run's file byte for byte, also after a
node is lost mid-run and after the driver is killed and resumed. One cluster serves the module."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lingctl.core.local_s3 import LocalS3Server
from tests.conftest import run_lingctl
from tests.flood.conftest import text_ckpt, tiny_ckpt  # noqa: F401  (the checkpoint fixtures)
from tests.flood.test_eval import gen_rows, mc_rows, write_jsonl

ray = pytest.importorskip("ray", reason="the lingctl[ray] extra (part of the dev extra) is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

EPOCH = "1700000000"  # SOURCE_DATE_EPOCH: answers' `created` fixed, so two runs compare byte for byte
FAST_HEALTH_CHECKS = {  # a lost node is noticed in about a second, not Ray's default half a minute
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
}
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
# The lingctl cache of the module's cluster nodes and lingctl commands (models copied from S3, flood's compiled
# kernels): one for all, so the kernels are compiled once.
CACHE: dict[str, str] = {}


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in os.environ while nodes start: a node's engines inherit its environment (S3 settings, the
    lingctl cache a node copies models into), as on a real cluster where each node has its own."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _add_node(c: Cluster) -> None:
    with _environment(c.node_env):  # type: ignore[attr-defined]
        c.add_node(**NODE_ARGS)
    c.wait_for_nodes()


@pytest.fixture(scope="module")
def cluster(s3_server: LocalS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    CACHE["LINGCTL_CACHE_DIR"] = str(tmp_path_factory.mktemp("lingctl-cache"))
    node_env = {**s3_server.env(), **CACHE}
    compile_kernels = "from lingctl.flood.engine.native import kernels; kernels()"
    subprocess.run([sys.executable, "-c", compile_kernels], env={**os.environ, **CACHE}, check=True, timeout=300)
    with _environment(node_env):
        c = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": 80 * 1024 * 1024,
                "include_dashboard": False,
                "_system_config": FAST_HEALTH_CHECKS,
            },
        )
    c.node_env = node_env  # type: ignore[attr-defined]
    try:
        for _ in range(2):
            _add_node(c)
        yield c
    finally:
        c.shutdown()


def _env() -> dict[str, str]:
    return {**os.environ, **CACHE, "SOURCE_DATE_EPOCH": EPOCH}


def _batch(path: Path, n: int, max_tokens: int, seed: int = 0) -> Path:
    """Token-id prompts; every third starts with the same 16 tokens (a prefix the engine shares), one line is
    not JSON and one prompt is out of the vocabulary (lines of the errors file)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        ids = [rng.randrange(2, 1000) for _ in range(rng.randint(3, 30))]
        if i % 3 == 0:
            ids = [7] * 16 + ids
        body = {
            "model": "tiny",
            "prompt": ids,
            "max_tokens": rng.randint(max_tokens // 2, max_tokens),
            "temperature": 0,
        }
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    lines.insert(3, "{not json")
    lines.insert(5, json.dumps({"custom_id": "oov", "prompt": [5, 99999], "max_tokens": 4}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _flood(batch: Path | str, model: Path | str, out: Path | str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lingctl", "flood", "run", str(batch), "--model", str(model), "-o", str(out),
            "--threads", "1", "--json", *extra]  # fmt: skip


def _local(batch: Path, model: Path, out: Path) -> dict[str, Any]:
    done = subprocess.run(_flood(batch, model, out), capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _ray(cluster: Cluster, *extra: str) -> list[str]:
    return ["--ray-address", cluster.address, "--ray-block", "4", *extra]


def _start_on(cluster: Cluster, batch: Path, model: Path, out: Path) -> subprocess.Popen[str]:
    """A cluster run in the background, for a test to interfere with."""
    cmd = _flood(batch, model, out, *_ray(cluster))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _same_files(a: Path, b: Path) -> None:
    for x, y in ((a, b), (a.with_name(a.stem + ".errors.jsonl"), b.with_name(b.stem + ".errors.jsonl"))):
        assert x.read_bytes() == y.read_bytes(), f"{x.name} and {y.name} differ"


def _wait_for_lines(path: Path, lines: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= lines:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before writing {lines} lines: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {lines} lines in {path} after {timeout} s")


def test_a_cluster_run_writes_the_local_run_s_file_byte_for_byte(cluster, tiny_ckpt, tmp_path) -> None:  # noqa: F811
    batch = _batch(tmp_path / "b.jsonl", 30, 12)
    local = _local(batch, tiny_ckpt, tmp_path / "local.jsonl")
    done = subprocess.run(
        _flood(batch, tiny_ckpt, tmp_path / "ray.jsonl", *_ray(cluster)),
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    _same_files(tmp_path / "local.jsonl", tmp_path / "ray.jsonl")
    assert summary["succeeded"] == local["succeeded"] == 30 and summary["failed"] == local["failed"] == 1
    engines = summary["cluster"]["engines"]
    assert len(engines) == 2 and len({e["node"] for e in engines}) == 2  # one engine on each node
    # Whichever engine is ready first starts; together they answered all 31 (the out-of-vocabulary one fails in one).
    assert sum(e["requests"] for e in engines) == 31 and summary["cluster"]["blocks"] >= 6
    assert summary["generated_tokens"] == local["generated_tokens"]
    # Requests sharing a prefix went to one engine: the answers' cached_tokens (in the bytes above) and the total agree.
    assert summary["prefix_tokens_saved"] == local["prefix_tokens_saved"] > 0


def test_a_cluster_evaluation_writes_the_local_evaluation_s_file(cluster, text_ckpt, tmp_path) -> None:  # noqa: F811
    mc = write_jsonl(tmp_path / "mc.jsonl", mc_rows(16))
    gen = write_jsonl(tmp_path / "gen.jsonl", gen_rows(4))
    common = ["flood", "eval", str(mc), str(gen), "--model", str(text_ckpt), "--threads", "1", "--json"]
    local = run_lingctl(*common, "-o", str(tmp_path / "local.jsonl"), env=_env())
    assert local.returncode == 0, local.stderr
    on_ray = run_lingctl(*common, "-o", str(tmp_path / "ray.jsonl"), *_ray(cluster), env=_env())
    assert on_ray.returncode == 0, on_ray.stderr
    assert (tmp_path / "local.jsonl").read_bytes() == (tmp_path / "ray.jsonl").read_bytes()
    a, b = json.loads(local.stdout), json.loads(on_ray.stdout)
    assert a["results"][0]["tasks"] == b["results"][0]["tasks"]
    assert b["results"][0]["cached_prompt_tokens"] == a["results"][0]["cached_prompt_tokens"] > 0


def test_a_node_lost_mid_run_loses_and_repeats_no_answer(cluster, tiny_ckpt, tmp_path) -> None:  # noqa: F811
    batch = _batch(tmp_path / "b.jsonl", 40, 160, seed=1)
    _local(batch, tiny_ckpt, tmp_path / "local.jsonl")
    out = tmp_path / "ray.jsonl"
    proc = _start_on(cluster, batch, tiny_ckpt, out)
    try:
        _wait_for_lines(out, 1, proc)  # both engines are at work, each with blocks queued
        victim = next(n for n in cluster.worker_nodes)
        cluster.remove_node(victim, allow_graceful=False)  # its raylet and the engine on it die at once
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        _add_node(cluster)  # the next test has two nodes again
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    _same_files(tmp_path / "local.jsonl", out)
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 40
    assert summary["cluster"]["retried_blocks"] >= 1
    assert sum(e["lost"] for e in summary["cluster"]["engines"]) == 1
    assert "was lost" in stderr and "Raylet is terminated" in stderr  # Ray's own message, on stderr too


def test_a_driver_killed_and_resumed_finishes_the_same_file(cluster, tiny_ckpt, tmp_path) -> None:  # noqa: F811
    batch = _batch(tmp_path / "b.jsonl", 30, 120, seed=2)
    _local(batch, tiny_ckpt, tmp_path / "local.jsonl")
    out = tmp_path / "ray.jsonl"
    proc = _start_on(cluster, batch, tiny_ckpt, out)
    try:
        _wait_for_lines(out, 2, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    written = [json.loads(line)["custom_id"] for line in out.read_text().splitlines() if line.endswith("}")]
    assert 2 <= len(written) < 30
    done = subprocess.run(
        _flood(batch, tiny_ckpt, out, *_ray(cluster), "--resume"),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    # 31 requests: 30 answers and the out-of-vocabulary one (its line in the errors file); none answered twice.
    assert summary["already_done"] >= len(written)
    assert summary["succeeded"] + summary["failed"] == 31 - summary["already_done"]
    _same_files(tmp_path / "local.jsonl", out)


def test_batch_model_and_outputs_in_s3(cluster, tiny_ckpt, tmp_path, s3_bucket, s3_env) -> None:  # noqa: F811
    """The driver stages the batch and uploads the outputs; each node copies the model into its own cache."""
    from lingctl.core.storage import S3Options, StoreURL, open_store

    batch = _batch(tmp_path / "b.jsonl", 12, 8, seed=3)
    _local(batch, tiny_ckpt, tmp_path / "local.jsonl")
    store = open_store(StoreURL("s3", s3_bucket), S3Options())
    store.write("in/b.jsonl", batch.read_bytes())
    for f in tiny_ckpt.iterdir():
        store.write(f"models/tiny/{f.name}", f.read_bytes())
    url = f"s3://{s3_bucket}"
    env = {**_env(), **s3_env}
    model = url + "/models/tiny"
    done = subprocess.run(
        _flood(url + "/in/b.jsonl", model, url + "/out/ray.jsonl", *_ray(cluster)),
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["out"] == url + "/out/ray.jsonl"
    for local, key in (("local.jsonl", "out/ray.jsonl"), ("local.errors.jsonl", "out/ray.errors.jsonl")):
        assert (tmp_path / local).read_bytes() == store.read(key), key


def test_ray_options_need_ray_and_ray_needs_its_extra(tiny_ckpt, tmp_path) -> None:  # noqa: F811
    batch = _batch(tmp_path / "b.jsonl", 2, 2)
    res = run_lingctl("flood", "run", str(batch), "--model", str(tiny_ckpt), "--ray-engines", "2")
    assert res.returncode == 2 and "--ray-engines applies to --ray runs only" in res.stderr
    # A Python where `import ray` fails, as without the extra: one line naming it, nothing written.
    hide = "import sys; sys.modules['ray'] = None; from lingctl.cli import main; sys.argv[0] = 'lingctl'; main()"
    args = ["flood", "run", str(batch), "--model", str(tiny_ckpt), "--ray", "-o", str(tmp_path / "o.jsonl")]
    res = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "pip install 'lingctl[ray]'" in res.stderr and "--ray needs Ray" in res.stderr
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_bytes() == b""
