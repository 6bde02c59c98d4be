"""Where lingctl keeps its state: LINGCTL_CACHE_DIR, else XDG_CACHE_HOME (when absolute), else ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from lingctl.core.cache import cache_dir, cache_root


def test_the_cache_root_follows_the_variables_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LINGCTL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "lingctl"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: a relative path is invalid
    assert cache_root() == tmp_path / "home" / ".cache" / "lingctl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "lingctl"
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("babel") == tmp_path / "mine" / "babel"
