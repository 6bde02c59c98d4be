"""save_figure: PNG and reproducible SVG, written whole or not at all."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from lingctl.core.figures import save_figure  # noqa: E402


def _figure() -> Figure:
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1, 2], [1.0, 0.5, 0.25], label="loss")
    ax.legend()
    return fig


def test_svg_is_the_same_file_when_drawn_twice(tmp_path: Path) -> None:
    files = []
    for name in ("a.svg", "b.svg"):
        fig = _figure()
        try:
            files.append(save_figure(fig, tmp_path / name, "svg").read_bytes())
        finally:
            plt.close(fig)
    assert files[0] == files[1]
    assert b"<svg" in files[0] and b"<dc:date>" not in files[0]
    assert b"loss" in files[0]  # text stays text, searchable


def test_png_is_written_and_a_failed_render_leaves_no_file(tmp_path: Path) -> None:
    fig = _figure()
    try:
        assert save_figure(fig, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
        fig.axes[0].set_title(r"$\frac{$")  # mathtext that cannot be parsed: the render fails
        with pytest.raises(ValueError):
            save_figure(fig, tmp_path / "b.png")
    finally:
        plt.close(fig)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]
