from __future__ import annotations

import pytest

from lingctl.core.atomic import TMP_MARKER, atomic_write


def test_replaces_only_on_success(tmp_path) -> None:
    target = tmp_path / "sub" / "file.bin"
    with atomic_write(target) as (tmp, f):
        f.write(b"complete")
        assert TMP_MARKER in tmp.name and not target.exists()
    assert target.read_bytes() == b"complete"


def test_failure_keeps_previous_content_and_leaves_no_temp(tmp_path) -> None:
    target = tmp_path / "file.bin"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as (_, f):
            f.write(b"half")
            raise RuntimeError("connection lost")
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]
