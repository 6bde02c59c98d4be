"""Every babel test keeps lingctl's cache (where sync journals live by default) in its own temporary
directory, never in the developer's home."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("LINGCTL_CACHE_DIR", str(tmp_path_factory.mktemp("lingctl-cache")))
