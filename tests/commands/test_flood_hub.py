"""``--model ORG/NAME`` through real ``lingctl`` processes, from a Hugging Face cache on disk, offline (an id that
is not cached fails before any work, so that case runs the CLI in this process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lingctl.cli import run as cli_run
from lingctl.core.errors import EXIT_NOT_FOUND, NotFoundError
from lingctl.flood.batch.output import manifest_path
from lingctl.model.safetensors_io import read_header
from tests.support.hf_cache import cache_repo


@pytest.fixture
def hub_env(tmp_path: Path, tiny_ckpt: Path) -> tuple[dict[str, str], Path]:
    """The flood ``tiny_ckpt`` cached as ``org/tiny-ling``; the environment of an offline machine."""
    home = tmp_path / "hf"
    snapshot = cache_repo(home, "org/tiny-ling", tiny_ckpt)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return env, snapshot


def test_flood_run_serves_a_cached_hub_id_offline(lingctl, hub_env, tmp_path):
    env, snapshot = hub_env
    batch = tmp_path / "b.jsonl"
    batch.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": [5 + i, 6, 7], "max_tokens": 3, "temperature": 0}) + "\n"
            for i in range(2)
        )
    )
    res = lingctl("flood", "run", str(batch), "--model", "org/tiny-ling", "--json", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["succeeded"] == 2
    answers = [json.loads(line) for line in (tmp_path / "b.output.jsonl").read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["r0", "r1"]
    for a in answers:
        body = a["response"]["body"]
        assert body["model"] == "org/tiny-ling"  # the id, not the snapshot's commit hash
        assert len(body["choices"][0]["token_ids"]) == 3
    manifest = json.loads(manifest_path(tmp_path / "b.output.jsonl").read_text())
    assert Path(manifest["model"]).resolve() == snapshot.resolve()  # the snapshot was read, fingerprinted


def test_pcache_plan_reads_a_cached_hub_id_and_names_a_missing_one(
    capsys, monkeypatch, lingctl, hub_env, tiny_ckpt, tmp_path
):
    env, _ = hub_env
    res = lingctl(
        "pcache",
        "plan",
        "--nodes",
        "1",
        "--ranks-per-node",
        "2",
        "--model",
        "org/tiny-ling",
        "--json",
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    model = json.loads(res.stdout)["model"]
    _, header = read_header(tiny_ckpt / "model.safetensors")
    assert model["source"] == "org/tiny-ling"
    assert model["tensors"] == len([name for name in header if name != "__metadata__"])
    assert model["layers"] == 2

    for var in ("HF_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, env[var])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    code = cli_run(["pcache", "plan", "--nodes", "1", "--ranks-per-node", "2", "--model", "org/not-cached@v2"])
    out, err = capsys.readouterr()
    assert code == EXIT_NOT_FOUND and out == ""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("lingctl: error:")]
    assert len(errors) == 1 and "org/not-cached@v2" in errors[0], err
    assert all(line.startswith("hint:") for line in lines if line not in errors), err


def test_flood_run_of_a_missing_id_writes_nothing(hub_env, tmp_path, monkeypatch):
    from lingctl.flood.batch.run import FloodOptions, run_batch

    env, _ = hub_env
    for var in ("HF_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, env[var])
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"custom_id": "r", "prompt": [5], "max_tokens": 1}) + "\n")
    with pytest.raises(NotFoundError) as info:
        run_batch(FloodOptions(batch=batch, model="org/not-cached"))
    assert "org/not-cached@main" in info.value.message and "\n" not in info.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jsonl", "hf"]  # no output, errors or manifest
