import pytest

from lingctl.core.errors import UsageError
from lingctl.core.units import format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("123", 123),
        ("1K", 1024),
        ("64MiB", 64 << 20),
        ("64M", 64 << 20),
        ("1.5G", int(1.5 * (1 << 30))),
        ("500MB", 500_000_000),
        ("2 GiB", 2 << 30),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "-5", "12 parsecs", "1.2.3M"])
def test_bad_sizes(text) -> None:
    with pytest.raises(UsageError, match="invalid size"):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 << 30) == "3.0 GiB"
