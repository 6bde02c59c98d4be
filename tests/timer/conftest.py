"""Timer fixtures: processes a test starts are killed at the end, whatever happened."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts; each is killed (by pid) at the end, whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
