"""Writing a matplotlib figure to a file, for every picture lingctl draws (a run's curves, an evaluation's scores).

The figure is rendered in memory first and then written with one atomic replace: a failed render leaves no file,
and a reader never sees half a picture. SVG output is reproducible (no timestamp, element ids from a fixed salt),
so a picture drawn twice from the same data is the same file.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lingctl.core.atomic import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.typing import RcKeyType

FigureFormat = Literal["png", "svg"]

SVG_RC: dict[RcKeyType, Any] = {
    "svg.hashsalt": "lingctl",  # element ids from a fixed salt, not a random one per save
    "svg.fonttype": "none",  # text stays text: smaller files, and searchable
}
SVG_METADATA: dict[str, Any] = {"Date": None}  # no timestamp in the file


def save_figure(fig: Figure, path: Path, fmt: FigureFormat = "png", *, dpi: int = 100) -> Path:
    """Render ``fig`` as ``fmt`` and write it to ``path`` atomically; returns ``path``."""
    import matplotlib

    buf = io.BytesIO()
    if fmt == "svg":
        with matplotlib.rc_context(SVG_RC):
            fig.savefig(buf, format="svg", metadata=SVG_METADATA)
    else:
        fig.savefig(buf, format="png", dpi=dpi)
    with atomic_write(Path(path)) as (_, f):
        f.write(buf.getvalue())
    return Path(path)
