"""``cache_repo`` writes what huggingface_hub's own cache readers accept."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.hf_cache import cache_repo


def test_huggingface_hub_reads_the_entry(tmp_path: Path) -> None:
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "bailing_moe"}')
    (src / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (src / "sub" / "notes.txt").write_text("nested")
    home, cache = tmp_path / "hf", tmp_path / "hf" / "hub"
    main = cache_repo(home, "org/tiny", src)
    tagged = cache_repo(home, "org/tiny", src, revision="v1", commit="c" * 40)
    assert main.parent == tagged.parent and main.name != tagged.name

    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type, repo.nb_files) == ("org/tiny", "model", 3)  # blobs shared by commits
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert set(revisions) == {main.name, "c" * 40}
    assert revisions[main.name].refs == frozenset({"main"}) and revisions["c" * 40].refs == frozenset({"v1"})
    assert {f.file_name for f in revisions[main.name].files} == {"config.json", "model.safetensors", "notes.txt"}

    for link in main.rglob("*"):
        if link.is_file():
            assert link.is_symlink() and not os.path.isabs(os.readlink(link))
            assert link.resolve().parent == cache / "models--org--tiny" / "blobs"
    found = try_to_load_from_cache("org/tiny", "config.json", cache_dir=cache, revision="v1")
    assert isinstance(found, str) and Path(found) == tagged / "config.json"
    assert Path(found).read_text() == '{"model_type": "bailing_moe"}'
    assert Path(snapshot_download("org/tiny", cache_dir=cache, local_files_only=True)) == main.resolve()
    found = snapshot_download("org/tiny", revision="v1", cache_dir=cache, local_files_only=True)
    assert Path(found) == tagged.resolve()
    assert (tagged / "sub" / "notes.txt").read_text() == "nested"
