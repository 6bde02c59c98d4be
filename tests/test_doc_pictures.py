"""The pictures under docs/images/ (made by scripts/doc_pictures.py) and the docs that show them agree: every
picture a page links exists, is an SVG that parses and stays small, and no picture lies there unused.

The script itself makes real training runs and is not run here.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
MAX_BYTES = 200 * 1024  # the script keeps each picture well under this; a larger one is a regression

# Markdown images, ![alt](path "title"), and HTML <img src="path">.
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\s[^>]*src=\"([^\"]+)\"")


def linked_images() -> dict[Path, list[str]]:
    """Every file under docs/images/ that a page links, with the pages that link it."""
    links: dict[Path, list[str]] = {}
    for page in PAGES:
        for match in IMAGE_LINK.finditer(page.read_text(encoding="utf-8")):
            target = (page.parent / (match.group(1) or match.group(2))).resolve()
            if target.is_relative_to(IMAGES.resolve()):
                links.setdefault(target, []).append(page.relative_to(ROOT).as_posix())
    return links


LINKED = linked_images()


def test_the_docs_show_pictures() -> None:
    assert LINKED, "no page links a picture under docs/images/"


@pytest.mark.parametrize("image", sorted(LINKED), ids=lambda p: p.name)
def test_linked_picture_is_a_small_svg(image: Path) -> None:
    pages = ", ".join(LINKED[image])
    assert image.is_file(), f"{pages} link {image.relative_to(ROOT)}, which does not exist"
    size = image.stat().st_size
    assert size < MAX_BYTES, f"{image.name} is {size:,} bytes; keep pictures under {MAX_BYTES:,}"
    root = ET.parse(image).getroot()
    assert root.tag in ("svg", "{http://www.w3.org/2000/svg}svg"), f"{image.name}: root element is {root.tag}"


def test_every_picture_is_linked() -> None:
    unused = [p.name for p in sorted(IMAGES.glob("*.svg")) if p.resolve() not in LINKED]
    assert not unused, f"pictures no page links: {unused}"
