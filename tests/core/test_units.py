import pytest

from lingctl.core.errors import UsageError
from lingctl.core.units import format_duration, format_size, format_whole_duration, parse_duration, parse_size


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


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90.0),
        ("1.5", 1.5),
        ("0", 0.0),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("2d", 172_800.0),
        ("1h30m", 5400.0),
        ("1m0.5s", 60.5),
        (" 2M ", 120.0),  # case and surrounding blanks do not matter
    ],
)
def test_parse_duration(text, seconds) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "invalid duration ''$"),
        ("soon", "invalid duration 'soon'$"),
        ("1x", "invalid duration '1x'$"),
        ("1m30", "invalid duration '1m30'$"),
        ("1 m", "invalid duration '1 m'$"),
        ("-5", "invalid duration '-5': must not be negative"),
        ("-30s", "invalid duration '-30s': must not be negative"),
        ("nan", "invalid duration 'nan': not a finite number"),
        ("inf", "invalid duration 'inf': not a finite number"),
        ("1e999", "invalid duration '1e999': not a finite number"),
    ],
)
def test_bad_durations_name_the_text(text, why) -> None:
    with pytest.raises(ValueError, match=why):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.4, "0.40s"), (2.345, "2.35s"), (12.34, "12.3s"), (42.4, "42s"), (75, "1m15s"), (3725, "1h2m5s")],
)
def test_format_duration(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown
    assert format_duration(float("inf")) == "-"


@pytest.mark.parametrize(
    ("seconds", "shown"), [(0.004, "0s"), (0.6, "1s"), (42.4, "42s"), (60, "1m0s"), (75, "1m15s"), (3600, "1h0m0s")]
)
def test_an_eta_or_a_wall_time_is_whole_seconds_as_rclone_writes_it(seconds: float, shown: str) -> None:
    assert format_whole_duration(seconds) == shown
    assert format_whole_duration(float("nan")) == "-"
