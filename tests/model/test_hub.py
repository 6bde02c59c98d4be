"""``--model ORG/NAME[@REV]``: Hub ids resolved from a real Hugging Face cache on disk (no network here)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from lingctl.core.errors import EXIT_NOT_FOUND, NotFoundError
from lingctl.model.hub import hub_cache_dir, is_repo_id, parse_repo_id, resolve_model_dir
from tests.support.hf_cache import cache_repo

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def model_src(root: Path, tag: str, *, config: bool = True) -> Path:
    """A minimal model directory whose files say which copy they are."""
    root.mkdir(parents=True)
    if config:
        (root / "config.json").write_text(json.dumps({"model_type": "bailing_moe", "tag": tag}))
    (root / "tokenizer.json").write_text(json.dumps({"tag": tag}))
    return root


def tag_of(directory: Path) -> str:
    return json.loads((directory / "config.json").read_text())["tag"]


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of its own for each test, read offline."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_cache_follows_hf_home_and_hf_hub_cache(hf_home, tmp_path, monkeypatch):
    assert hub_cache_dir() == hf_home / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_local_directory_wins_over_an_id_of_the_same_name(hf_home, tmp_path, monkeypatch):
    cache_repo(hf_home, "org/name", model_src(tmp_path / "hub-copy", "hub"))
    work = tmp_path / "work"
    model_src(work / "org" / "name", "local")
    monkeypatch.chdir(work)
    got = resolve_model_dir("org/name")
    assert got == Path("org/name") and tag_of(got) == "local"
    monkeypatch.chdir(tmp_path)  # no such local directory here: the id is looked up
    assert tag_of(resolve_model_dir("org/name")) == "hub"


def test_revisions_resolve_to_their_snapshots(hf_home, tmp_path):
    snap_a = cache_repo(hf_home, "org/name", model_src(tmp_path / "a", "A"), revision="main", commit=COMMIT_A)
    snap_b = cache_repo(hf_home, "org/name", model_src(tmp_path / "b", "B"), revision="refs/pr/1", commit=COMMIT_B)
    cache_repo(hf_home, "org/name", model_src(tmp_path / "b2", "B"), revision="v1.0", commit=COMMIT_B)
    assert snap_a.name == COMMIT_A and snap_b.name == COMMIT_B
    cases = {
        "org/name": "A",
        "org/name@main": "A",
        "org/name@refs/pr/1": "B",
        "org/name@v1.0": "B",
        f"org/name@{COMMIT_A}": "A",
        f"org/name@{COMMIT_B}": "B",
    }
    for spec, tag in cases.items():
        got = resolve_model_dir(spec)
        assert got.resolve() == (snap_a if tag == "A" else snap_b).resolve(), spec
        assert tag_of(got) == tag, spec


def test_offline_and_not_cached_is_one_line_naming_id_revision_and_cache(hf_home, tmp_path):
    cache_repo(hf_home, "org/name", model_src(tmp_path / "a", "A"))
    for spec, revision in [("org/missing", "main"), ("org/name@v2", "v2"), (f"org/name@{COMMIT_B}", COMMIT_B)]:
        with pytest.raises(NotFoundError) as info:
            resolve_model_dir(spec)
        err = info.value
        assert err.exit_code == EXIT_NOT_FOUND
        assert "\n" not in err.message and "\n" not in (err.hint or "")
        repo_id = spec.split("@")[0]
        assert f"--model {repo_id}@{revision}" in err.message, err.message
        assert str(hf_home / "hub") in err.message and "HF_HUB_OFFLINE" in err.message
        assert (
            err.hint is not None
            and f"hf download {repo_id} --revision {revision}" in err.hint
            and "HF_HUB_OFFLINE" in err.hint
        )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_falls_back_to_the_cache_or_fails_in_one_line(hf_home, tmp_path, monkeypatch):
    import huggingface_hub.constants

    port = _closed_port()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    # huggingface_hub reads HF_HUB_OFFLINE once, when first imported: make the library agree with this test.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
    snap = cache_repo(hf_home, "org/name", model_src(tmp_path / "a", "A"), revision="v1", commit=COMMIT_A)
    assert resolve_model_dir("org/name@v1").resolve() == snap.resolve()  # cached: served without the Hub

    with pytest.raises(NotFoundError) as info:
        resolve_model_dir("org/missing@v1", option="--init-from")
    message = info.value.message
    assert "\n" not in message
    assert "--init-from org/missing@v1" in message and str(hf_home / "hub") in message
    assert f"127.0.0.1:{port}" in message and "could not be reached" in message, message
    assert info.value.hint is not None and "hf download org/missing --revision v1" in info.value.hint


@pytest.mark.parametrize(
    "spec",
    [
        "org",
        "org/name/extra",
        "org//name",
        "-org/name",
        "org/name.",
        "org--x/name",
        "org/na..me",
        "org/name.git",
        "org/na me",
        "org/name@",
        "org/name@../../x",
        "org/name@v1 x",
        "org/name@.hidden",
        "org/name@a//b",
        "./org/name",
        "/abs/org/name",
    ],
)
def test_malformed_ids_are_rejected(hf_home, tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id(spec) and parse_repo_id(spec) is None
    with pytest.raises(NotFoundError) as info:
        resolve_model_dir(spec)
    assert spec in info.value.message and "no such directory" in info.value.message
    assert not (hf_home / "hub").exists()  # never looked up


def test_well_formed_ids():
    for spec in [
        "org/name",
        "inclusionAI/Ling-lite-1.5",
        "a_b/c.d-e",
        "org/name@main",
        "org/name@refs/pr/3",
        f"org/name@{COMMIT_A}",
        "org/name@v2.0-rc1",
    ]:
        assert is_repo_id(spec), spec
    got = parse_repo_id("org/name@refs/pr/3")
    assert got is not None and (got.repo_id, got.revision) == ("org/name", "refs/pr/3")


def test_snapshot_without_config_json_is_an_error_naming_it(hf_home, tmp_path):
    snap = cache_repo(hf_home, "org/no-config", model_src(tmp_path / "a", "A", config=False))
    with pytest.raises(NotFoundError) as info:
        resolve_model_dir("org/no-config")
    message = info.value.message
    assert "config.json" in message and f"models--org--no-config/snapshots/{snap.name}" in message
    assert "org/no-config@main" in message
    assert "\n" not in message
