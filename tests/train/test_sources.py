"""What a run starts from: ``--tokenizer`` as a file, a directory or a cached Hub id, and ``--init-from``
checks that happen before any data is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingctl.core.errors import LingctlError, NotFoundError
from lingctl.model.tokenizer import train_tokenizer
from lingctl.train.sources import open_init_source, tokenizer_source
from tests.support.hf_cache import cache_repo


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer([f"alpha beta gamma {i}\n" for i in range(50)], 300)
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (path / "config.json").write_text(json.dumps({"model_type": "bailing_moe"}))
    return path


def test_tokenizer_as_file_directory_or_hub_id(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file, config = tokenizer_source(str(tokenizer_dir / "tokenizer.json"))
    assert file == tokenizer_dir / "tokenizer.json" and config == {"chat_template": "{{ messages }}"}
    assert tokenizer_source(str(tokenizer_dir)) == (file, config)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snapshot = cache_repo(tmp_path / "hf", "some-org/some-model", tokenizer_dir)
    got, got_config = tokenizer_source("some-org/some-model")
    assert got.parent == snapshot and got.read_text() == file.read_text() and got_config == config
    with pytest.raises(NotFoundError, match="tokenizer.json"):
        tokenizer_source(str(tmp_path))
    with pytest.raises(NotFoundError, match="other-org/missing"):
        tokenizer_source("other-org/missing")


def test_init_from_without_weights_or_with_pickles_is_refused_early(tmp_path: Path) -> None:
    from lingctl.model.checkpoint import save_checkpoint
    from lingctl.model.ling import LingForCausalLM
    from lingctl.model.presets import preset

    ckpt = tmp_path / "ckpt"
    save_checkpoint(LingForCausalLM(preset("tiny")), ckpt)
    assert open_init_source(str(ckpt)).config.num_hidden_layers == 2
    (ckpt / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(NotFoundError, match="no model.safetensors"):
        open_init_source(str(ckpt))
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not a pickle to open")
    with pytest.raises(LingctlError, match="pickled weights"):
        open_init_source(str(ckpt))
    with pytest.raises(NotFoundError):
        open_init_source(str(tmp_path / "absent"))
