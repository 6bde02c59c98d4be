from __future__ import annotations

import pytest

from lingctl.babel.filters import KeyFilter, glob_to_regex, parse_shard
from lingctl.babel.index import ListingIndex
from lingctl.babel.transfer import MAX_PARTS, MiB, part_size_for
from lingctl.core.errors import UsageError
from lingctl.core.storage.retry import Aimd


def test_listing_index_spills_to_disk_past_its_threshold_and_keeps_answering() -> None:
    index = ListingIndex(spill_at=100)
    index.add_many((f"k{i:05d}", i, float(i), None) for i in range(60))
    assert not index.spilled and index.get("k00042") == (42, 42.0, None)
    index.add_many((f"k{i:05d}", i, float(i), f"e{i}") for i in range(60, 500))
    assert index.spilled and index.count == 500
    assert index.get("k00042") == (42, 42.0, None) and index.get("k00499") == (499, 499.0, "e499")
    assert "missing" not in index and "k00100" in index
    keys = [k for k, _ in index.items()]
    assert keys == sorted(keys) and len(keys) == 500
    index.close()


@pytest.mark.parametrize(
    "pattern,key,hit",
    [
        ("*.tmp", "a/b/c.tmp", True),
        ("*.tmp", "c.tmp", True),
        ("*.tmp", "a/c.tmpx", False),
        ("/top.txt", "top.txt", True),
        ("/top.txt", "a/top.txt", False),
        ("dir/*", "dir/x", True),
        ("dir/*", "dir/x/y", False),
        ("dir/**", "dir/x/y", True),
        ("a?c", "abc", True),
        ("a?c", "a/c", False),
        ("[ab].txt", "b.txt", True),
        ("[ab].txt", "c.txt", False),
    ],
)
def test_globs_follow_rclone_semantics(pattern: str, key: str, hit: bool) -> None:
    assert bool(glob_to_regex(pattern).match(key)) is hit


def test_include_exclude_and_shards() -> None:
    f = KeyFilter(include=["*.bin"], exclude=["tmp/**"])
    assert f("a/x.bin") and not f("tmp/x.bin") and not f("a/x.txt")
    keys = [f"obj-{i}" for i in range(1000)]
    shards = [KeyFilter(shard=(i, 3)) for i in range(3)]
    owners = [sum(s(k) for s in shards) for k in keys]
    assert owners == [1] * 1000  # every key in exactly one shard
    assert all(200 < sum(s(k) for k in keys) < 470 for s in shards)
    assert parse_shard("2/4") == (2, 4) and parse_shard(None) == (0, 1)
    for bad in ("4/4", "x", "1/0"):
        with pytest.raises(UsageError):
            parse_shard(bad)


def test_part_size_adapts_to_the_object() -> None:
    assert part_size_for(10 * MiB, None) == 8 * MiB
    assert part_size_for(100 * 1024 * MiB, None) * MAX_PARTS >= 100 * 1024 * MiB
    assert part_size_for(10 * MiB, 1 * MiB) == 5 * MiB  # S3's minimum part size


def test_aimd_halves_on_throttle_once_per_cooldown_and_grows_back() -> None:
    gate = Aimd(16, cooldown_s=10.0)
    for _ in range(3):
        gate.acquire()
    gate.release(throttled=True)
    gate.release(throttled=True)  # the same burst: no second cut
    assert gate.limit == 8.0
    gate.release()
    assert 8.0 < gate.limit < 8.2
    assert gate.lowest == 8.0
