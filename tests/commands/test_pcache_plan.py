"""`lingctl pcache plan`: the JSON schema, the human table, the config file and one-line usage errors."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from lingctl.commands.pcache import app
from lingctl.core.errors import EXIT_USAGE, UsageError
from lingctl.pcache.plan import MAX_RANKS

BASE = ["plan", "--nodes", "2", "--ranks-per-node", "2", "--model", "small"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def plan_json(*args: str) -> dict:
    result = invoke(*BASE, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_schema():
    data = plan_json("--optimizer", "sgd")
    assert set(data) == {
        "model",
        "optimizer",
        "dtype",
        "parallelism",
        "topology",
        "chunk_bytes",
        "buffer_bytes",
        "items",
        "chunks",
        "total_bytes",
        "plan_seconds",
        "strategies",
        "ranks",
        "write_items",
    }
    assert data["write_items"] is None and isinstance(data["plan_seconds"], float)
    assert data["parallelism"] == {"tp": 1, "pp": 1, "dp": 4, "ep": 1, "order": "tp-ep-dp-pp", "shard_optimizer": False}
    assert data["topology"] == {"rank_nodes": [0, 0, 1, 1], "node_gbps": [2.0, 2.0]}
    assert [s["name"] for s in data["strategies"]] == ["rank0", "dcp", "lingctl", "bound"]
    for s in data["strategies"]:
        assert set(s) == {
            "name",
            "label",
            "writes",
            "total_bytes",
            "rank_bytes_max",
            "rank_bytes_mean",
            "node_bytes",
            "node_ratio",
            "seconds",
            "vs_bound",
            "staging_bytes",
            "staging_async_bytes",
        }
        assert s["total_bytes"] == data["total_bytes"]
    rank = data["ranks"][1]
    assert set(rank) == {"rank", "node", "held_bytes", "bytes", "writes", "staging"}
    assert set(rank["bytes"]) == {"rank0", "dcp", "lingctl"}
    assert sum(r["bytes"]["dcp"] for r in data["ranks"]) == data["total_bytes"]


def test_items_lists_every_write():
    data = plan_json("--tp", "2", "--chunk-mb", "0.5", "--items")
    assert len(data["write_items"]) == data["items"]
    assert sum(len(item["lingctl"]) for item in data["write_items"]) == data["chunks"] > data["items"]
    first = data["write_items"][0]
    assert first["name"] == "model.word_embeddings.weight[0:4096]" and first["holders"] == 2


def test_size_options_take_units_as_the_other_size_options_do():
    assert plan_json("--chunk-mb", "0.5")["chunk_bytes"] == plan_json("--chunk-mb", "512KiB")["chunk_bytes"] == 2**19
    assert plan_json("--buffer-mb", "1G")["buffer_bytes"] == 2**30


def test_human_table():
    result = invoke(*BASE, "--node-bandwidth", "2,1")
    assert result.exit_code == 0, result.output
    for word in ("rank-0 writers", "DCP default", "lingctl plan", "lower bound", "bytes per node", "1-2 GB/s"):
        assert word in result.stdout


def test_config_file_and_flags_over_it(tmp_path):
    config = tmp_path / "plan.toml"
    config.write_text(
        '[pcache]\nmodel = "tiny"\nrank_map = [0, 0, 1, 1]\nnode_bandwidth = [1, 3]\ntp = 2\nshard_optimizer = true\n'
    )
    data = json.loads(invoke("plan", "--config", str(config), "--json", "--tp", "1").stdout)
    assert data["model"]["source"] == "tiny"
    assert data["parallelism"]["tp"] == 1 and data["parallelism"]["dp"] == 4
    assert data["parallelism"]["shard_optimizer"] is True
    assert data["topology"]["node_gbps"] == [1.0, 3.0]
    config.write_text('[pcache]\nmodle = "tiny"\n')
    result = invoke("plan", "--config", str(config))
    assert isinstance(result.exception, UsageError) and "modle" in str(result.exception)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--tp", "2", "--dp", "4"], ["4 ranks", "tp 2 x pp 1 x dp 4 = 8"]),
        (["--ep", "3"], ["ep 3", "dp 4"]),
        (["--pp", "4", "--model", "tiny"], ["pp 4", "2 layers"]),
        (["--tp", "3", "--ranks-per-node", "3"], ["tp 3", "8 attention heads"]),
        (["--model", "ling-max"], ["'ling-max'"]),
        (["--model", "/no/such/dir"], ["/no/such/dir"]),
        (["--node-bandwidth", "1,2,3"], ["3 bandwidth value(s) for 2 node(s)"]),
        (["--node-bandwidth", "1,fast"], ["'fast'"]),
        (["--rank-map", "0,0,1"], ["3 ranks", "2 nodes x 2 ranks per node = 4"]),
        (["--optimizer", "lion"], ["'lion'"]),
        (["--chunk-mb", "0"], ["chunk-mb", "0"]),
        (["--order", "tp-dp"], ["'tp-dp'"]),
    ],
)
def test_usage_errors_name_the_values(args, words):
    result = invoke(*BASE, *args)
    assert isinstance(result.exception, UsageError), result.output
    assert result.exception.exit_code == EXIT_USAGE
    message = str(result.exception)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_missing_topology_and_model():
    result = invoke("plan", "--model", "tiny")
    assert isinstance(result.exception, UsageError) and "--nodes" in str(result.exception)
    result = invoke("plan", "--nodes", "1", "--ranks-per-node", "1")
    assert isinstance(result.exception, UsageError) and "model" in str(result.exception)


def test_worlds_beyond_the_limit_are_refused_at_once(tmp_path):
    started = time.monotonic()
    result = invoke("plan", "--nodes", "100000", "--ranks-per-node", "1000", "--model", "tiny")
    assert isinstance(result.exception, UsageError), result.output
    assert "100,000,000 ranks" in str(result.exception) and f"{MAX_RANKS:,}" in str(result.exception)
    assert time.monotonic() - started < 10  # it used to run for minutes
    rank_map = tmp_path / "ranks.json"
    rank_map.write_text(json.dumps([r // 8 for r in range(MAX_RANKS + 1)]))
    result = invoke("plan", "--rank-map", str(rank_map), "--model", "tiny")
    assert isinstance(result.exception, UsageError) and f"{MAX_RANKS + 1:,} ranks" in str(result.exception)


def test_real_process_errors_and_json(lingctl):
    """Through ``python -m lingctl``: a bad input is one error line (and a hint) on stderr with exit code 2,
    never a traceback; a good ``--json`` run prints the plan and lingctl's is within 2% of balanced."""
    topology = ("--nodes", "2", "--ranks-per-node", "2")
    bad = [
        (["--tp", "3", "--model", "tiny"], ["tp 3", "4 ranks"]),
        (["--node-bandwidth", "1,2,3", "--model", "tiny"], ["3 bandwidth value(s)", "2 node(s)"]),
        (["--nodes", "100000", "--ranks-per-node", "1000", "--model", "tiny"], ["100,000,000 ranks"]),
    ]
    for args, words in bad:
        r = lingctl("pcache", "plan", *topology, *args)
        assert r.returncode == EXIT_USAGE == 2, r.stderr
        assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.splitlines()
        errors = [line for line in lines if line.startswith("lingctl: error:")]
        assert len(errors) == 1, r.stderr
        assert all(word in errors[0] for word in words), errors[0]
        others = [line for line in lines if line not in errors]
        assert len(others) <= 1 and all(line.startswith("hint:") for line in others), r.stderr

    r = lingctl("pcache", "plan", *topology, "--model", "small", "--json")
    assert r.returncode == 0, r.stderr
    strategies = {s["name"]: s for s in json.loads(r.stdout)["strategies"]}
    assert list(strategies) == ["rank0", "dcp", "lingctl", "bound"]
    assert strategies["lingctl"]["node_ratio"] <= 1.02
