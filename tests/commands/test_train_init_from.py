"""`lingctl train --init-from`: a run that starts from a Hub-layout Ling checkpoint (sharded, with index,
tokenizer_config.json and a local-code auto_map) named by its Hub id from the Hugging Face cache, offline;
the run's checkpoints keep its tokenizer config and code reference, and flood answers chat requests on them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lingctl.core.errors import UsageError
from lingctl.model.checkpoint import load_checkpoint, model_state, save_checkpoint
from lingctl.model.checkpoint_files import WEIGHTS_INDEX
from lingctl.model.ling import LingForCausalLM
from lingctl.model.presets import preset
from lingctl.model.tokenizer import train_tokenizer
from tests.support.hf_cache import cache_repo

REPO_ID = "example-org/ling-tiny"
# A template of the source's own, different from lingctl's: the run's checkpoints must carry it.
SOURCE_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 4 %}{% break %}{% endif %}"
    "<role>{{ m['role'] | upper }}</role>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<role>ASSISTANT</role>{% endif %}"
)
COMMON = (
    "--steps",
    "2",
    "--save-every",
    "2",
    "--eval-every",
    "0",
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--lr",
    "1e-9",
    "--json",
)


def _source(root: Path, corpus: Path) -> tuple[Path, LingForCausalLM]:
    """A Hub-layout checkpoint: shards + index, tokenizer files, auto_map naming code beside the weights."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.iterdir())]
    tok = train_tokenizer(texts, 400)
    cfg = preset("tiny")
    cfg.vocab_size = tok.get_vocab_size()
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None
    cfg.eos_token_id = cfg.pad_token_id = eos
    model = LingForCausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(7))
    src = root / "source"
    save_checkpoint(model, src, tokenizer_json=tok.to_str(), max_shard_size="100KB", code_repo=None)
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = SOURCE_TEMPLATE
    (src / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return src, model


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory, text_corpus: Path) -> dict:
    from tests.conftest import run_lingctl

    root = tmp_path_factory.mktemp("init")
    src, model = _source(root, text_corpus)
    hf_home = root / "hf"
    cache_repo(hf_home, REPO_ID, src)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    run = root / "run"
    res = run_lingctl(
        "train",
        "--init-from",
        REPO_ID,
        "--data",
        str(text_corpus),
        "--max-shard-size",
        "100KB",
        "--out",
        str(run),
        *COMMON,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    done = [json.loads(line) for line in res.stdout.splitlines()][-1]
    return {"root": root, "src": src, "model": model, "run": run, "done": done, "env": env, "corpus": text_corpus}


def test_run_starts_from_the_cached_hub_checkpoint(started: dict) -> None:
    done, src = started["done"], started["src"]
    assert done["event"] == "done" and done["steps"] == 2
    ckpt = started["run"] / done["checkpoint"]
    # Its shape and (after two steps at lr 1e-9) its weights are the source's.
    assert json.loads((ckpt / "config.json").read_text())["num_hidden_layers"] == 2
    trained = model_state(load_checkpoint(ckpt))
    for name, tensor in model_state(started["model"]).items():
        assert torch.allclose(trained[name], tensor, atol=1e-6), name
    # Its tokenizer is the source's (same ids), not one trained on the data.
    assert Tokenizer.from_file(str(ckpt / "tokenizer.json")).to_str() == (src / "tokenizer.json").read_text()
    # Hub files: shards with an index, the source's chat template, and lingctl's own code named by auto_map.
    assert len(set(json.loads((ckpt / WEIGHTS_INDEX).read_text())["weight_map"].values())) > 1
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"] == SOURCE_TEMPLATE
    auto_map = json.loads((ckpt / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_bailing_moe.BailingMoeForCausalLM"
    assert (ckpt / "modeling_bailing_moe.py").is_file() and (ckpt / "configuration_bailing_moe.py").is_file()


def test_flood_answers_chat_on_the_runs_checkpoint_and_resume_keeps_the_shape(started: dict) -> None:
    from tests.conftest import run_lingctl

    run, env = started["run"], started["env"]
    ckpt = run / started["done"]["checkpoint"]
    batch = started["root"] / "chat.jsonl"
    batch.write_text(
        "".join(
            json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": q}], "max_tokens": 4}) + "\n"
            for i, q in enumerate(["def main():", "import json"])
        )
    )
    out = started["root"] / "chat.out.jsonl"
    res = run_lingctl(
        "flood", "run", str(batch), "--model", str(ckpt), "--out", str(out), "--threads", "1", env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["c0", "c1"]
    assert all(a.get("error") is None for a in answers), answers
    # Resuming needs only the run: the model shape comes from its own checkpoint.
    res = run_lingctl(
        "train",
        "--resume",
        "--out",
        str(run),
        "--steps",
        "3",
        "--save-every",
        "3",
        "--json",
        "--data",
        str(started["corpus"]),
        env={**env, "HF_HOME": str(started["root"] / "empty")},
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    done = [json.loads(line) for line in res.stdout.splitlines()][-1]
    assert done["steps"] == 3 and done["resumed_from"] == 2


def test_shape_mismatches_are_one_line_errors(started: dict, tmp_path: Path) -> None:
    from lingctl.train.run import train

    src = str(started["src"])
    with pytest.raises(UsageError, match=r"--preset small has hidden_size=256 but the checkpoint .* has 64"):
        train(out=str(tmp_path / "a"), resume=False, overrides={"init_from": src, "preset": "small"})
    with pytest.raises(UsageError, match=r"model.num_hidden_layers=3 does not match the checkpoint .* has 2"):
        train(
            out=str(tmp_path / "b"),
            resume=False,
            overrides={
                "init_from": src,
                "model.num_hidden_layers": 3,
                "data.paths": [str(started["corpus"])],
                "seq_len": 32,
            },
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
