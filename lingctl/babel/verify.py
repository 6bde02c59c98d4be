"""``babel verify``: compare two trees object by object; every difference is named with both sides' figures.

Modes: ``meta`` compares presence and sizes (from the two listings, no reads); ``sampled`` also compares the
CRC64NVME of the same deterministic ranges on both sides (``sampling.sample_ranges``: small objects whole,
large ones through ``samples`` blocks of 1 MiB including the first and last); ``full`` compares whole-object
CRCs, reading everything.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lingctl.babel.filters import KeyFilter
from lingctl.babel.index import ListingIndex
from lingctl.babel.listing import ListStats, list_tree
from lingctl.babel.sampling import DEFAULT_SAMPLES, sample_ranges
from lingctl.babel.sync import STATE_DIR_NAME
from lingctl.babel.transfer import compare
from lingctl.core.errors import UsageError
from lingctl.core.storage import Aimd, ObjectStore, S3Options, StoreURL, open_store


@dataclass(kw_only=True, slots=True)
class VerifyResult:
    source: str
    destination: str
    mode: str
    checked: int = 0
    matched: int = 0
    bytes_read: int = 0  # per side: what the comparison read (sampled ranges, or whole objects)
    differences: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.differences


def verify(
    src_url: StoreURL,
    dst_url: StoreURL,
    s3: S3Options,
    *,
    mode: str = "sampled",
    samples: int = DEFAULT_SAMPLES,
    jobs: int = 16,
    key_filter: KeyFilter | None = None,
) -> VerifyResult:
    if mode not in ("meta", "sampled", "full"):
        raise UsageError(f"--mode must be meta, sampled or full, got {mode!r}")
    start = time.monotonic()
    gate = Aimd(jobs)
    src, dst = open_store(src_url, s3, gate=gate), open_store(dst_url, s3, gate=gate)
    src.check()
    dst.check()
    keep = key_filter or KeyFilter()
    result = VerifyResult(source=src.describe(), destination=dst.describe(), mode=mode)
    a, b = (_index(url, s3, jobs, keep) for url in (src_url, dst_url))
    try:
        pairs = _compare_listings(a, b, result.differences)
        result.checked = len(pairs)
        if mode == "meta":
            result.matched = len(pairs)
        else:
            _compare_contents(src, dst, pairs, result, samples=samples, jobs=jobs)
    finally:
        a.close()
        b.close()
    result.differences.sort(key=lambda d: d["key"])
    result.seconds = round(time.monotonic() - start, 3)
    return result


def _index(url: StoreURL, s3: S3Options, jobs: int, keep: KeyFilter) -> ListingIndex:
    index = ListingIndex()
    for batch in list_tree(url, s3, jobs=jobs, stats=ListStats(), skip_dirs=frozenset({STATE_DIR_NAME})):
        index.add_many((e.key, e.size, e.mtime, e.etag) for e in batch if keep(e.key))
    return index


def _compare_listings(a: ListingIndex, b: ListingIndex, differences: list[dict]) -> list[tuple[str, int]]:
    """Record the objects on one side only, or of another size on each; return the (key, size) pairs whose
    contents are left to compare."""
    pairs = []
    for key, (size, _, _) in a.items():
        other = b.get(key)
        if other is None:
            differences.append({"key": key, "problem": "missing in destination", "source_size": size})
        elif other[0] != size:
            differences.append(
                {"key": key, "problem": "size differs", "source_size": size, "destination_size": other[0]}
            )
        else:
            pairs.append((key, size))
    for key, (size, _, _) in b.items():
        if key not in a:
            differences.append({"key": key, "problem": "only in destination", "destination_size": size})
    return pairs


def _compare_contents(
    src: ObjectStore,
    dst: ObjectStore,
    pairs: list[tuple[str, int]],
    result: VerifyResult,
    *,
    samples: int,
    jobs: int,
) -> None:
    mode = result.mode

    def check(pair: tuple[str, int]) -> dict | None:
        key, size = pair
        diff = compare(src, dst, key, size, mode, samples=samples)
        if diff is None:
            return None
        return {
            "key": key,
            "problem": f"content differs ({mode})",
            "source_size": size,
            "destination_size": size,
            "source_checksum": diff[0],
            "destination_checksum": diff[1],
        }

    with ThreadPoolExecutor(jobs) as pool:
        for (key, size), found in zip(pairs, pool.map(check, pairs)):
            if found is None:
                result.matched += 1
            else:
                result.differences.append(found)
            result.bytes_read += (
                size if mode == "full" else sum(n for _, n in sample_ranges(key, size, samples=samples))
            )
