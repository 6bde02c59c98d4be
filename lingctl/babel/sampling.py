"""Content-sampled verification: which byte ranges of an object to CRC on both sides of a copy.

Reading every byte of a 100 GiB checkpoint on both sides to verify a copy costs as much as the copy. Instead
both sides CRC the same few ranges: the first and last ``sample_size`` bytes, where truncation and format
damage to checkpoint and tensor files show (headers, index tables, trailers), plus ``samples - 2``
pseudo-random ``sample_size``-aligned blocks. The choice is a pure function of the object's key and size,
seeded through BLAKE2b rather than Python's per-process salted ``hash()``, so the source, the destination and
a re-verify next week on another machine read the same ranges. Objects no larger than
``samples * sample_size`` are read whole: sampling them would save little and miss a lot.

Callers compare sizes first and compute the ranges from the source's size: a truncated destination has a
different size, and that alone fails the check.

What sampling catches (the default 64 x 1 MiB on a 100 GiB file reads 64 MiB, 0.0625% of it):

- truncation or a wrong length: always (the sizes differ);
- damage to the first or last MiB (headers, trailers): always;
- damage spread over a fraction ``f`` of the 1 MiB blocks: ``1 - (1 - f)**64`` (``block_damage_detection``),
  i.e. 47% at f = 1%, 96% at f = 5%, 99.9% at f = 10%, but only 6% at f = 0.1%;
- one flipped byte at a random position: ~0.0006 (``detection_probability``).

So sampling is a check against systematic damage (a wrong, stale, short or zero-filled object, a bad
transfer layer), not against rare random bit flips; those need a full-object checksum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

DEFAULT_SAMPLES = 64
DEFAULT_SAMPLE_SIZE = 1 << 20  # 1 MiB: large enough that a read is throughput-bound, not latency-bound
_PERSON = b"lingctl-sampling"  # BLAKE2b personalisation: these digests mean nothing elsewhere


def _check(samples: int, sample_size: int) -> None:
    if samples < 2:
        raise ValueError(f"samples must be >= 2 (the first and last blocks are always read), got {samples}")
    if sample_size < 1:
        raise ValueError(f"sample_size must be >= 1, got {sample_size}")


def _seed(key: str, size: int) -> bytes:
    # Length-prefixing the key keeps ("a", 12) and ("a1", 2)-style pairs from sharing an encoding.
    data = key.encode("utf-8")
    return hashlib.blake2b(
        len(data).to_bytes(8, "little") + data + size.to_bytes(16, "little"), digest_size=32, person=_PERSON
    ).digest()


def _below(seed: bytes, counter: int, n: int) -> int:
    """The ``counter``-th pseudo-random integer in [0, n): 128 bits reduced mod n, bias < n / 2**128."""
    digest = hashlib.blake2b(seed + counter.to_bytes(8, "little"), digest_size=16, person=_PERSON).digest()
    return int.from_bytes(digest, "little") % n


def _choose(seed: bytes, population: int, k: int) -> list[int]:
    """``k`` distinct integers from ``range(population)``, k <= population.

    A partial Fisher-Yates shuffle over a sparse swap table: exactly k draws, O(k) memory whatever the
    population (2**40 blocks of a large object). ``random.sample`` would do, but only ``random()`` is
    promised to stay the same across Python versions, and a re-verify may run on a newer one.
    """
    swapped: dict[int, int] = {}
    chosen = []
    for i in range(k):
        j = i + _below(seed, i, population - i)
        chosen.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    return chosen


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and merge touching or overlapping (offset, length) ranges, so each read is one request."""
    merged: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            start, prev = merged[-1]
            merged[-1] = (start, max(prev, offset + length - start))
        else:
            merged.append((offset, length))
    return merged


def sample_ranges(
    key: str, size: int, *, samples: int = DEFAULT_SAMPLES, sample_size: int = DEFAULT_SAMPLE_SIZE
) -> list[tuple[int, int]]:
    """The sorted, non-overlapping ``(offset, length)`` ranges of an object to CRC when verifying it.

    ``key`` is the object's key relative to the tree being copied, the same on both sides. Objects of at most
    ``samples * sample_size`` bytes are read whole (``[(0, size)]``, or ``[]`` when empty). Larger ones get
    the first ``sample_size`` bytes, the last ``sample_size`` bytes (``size - sample_size``, not necessarily
    aligned) and ``samples - 2`` distinct aligned blocks between them, touching ranges merged.
    """
    _check(samples, sample_size)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if size == 0:
        return []
    if size <= samples * sample_size:
        return [(0, size)]
    # Aligned blocks 1 .. size // sample_size - 2 lie wholly between the first block and the tail range.
    # size > samples * sample_size gives at least samples - 2 of them.
    inner = size // sample_size - 2
    blocks = _choose(_seed(key, size), inner, samples - 2)
    ranges = [(0, sample_size), (size - sample_size, sample_size)]
    ranges += [((1 + b) * sample_size, sample_size) for b in blocks]
    return _merge(ranges)


def coverage(size: int, ranges: Iterable[tuple[int, int]]) -> float:
    """The fraction of the object's bytes that ``ranges`` cover (1.0 for an empty object: nothing is unread)."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if size == 0:
        return 1.0
    clipped = [(max(0, o), min(size, o + n) - max(0, o)) for o, n in ranges if n > 0 and o < size and o + n > 0]
    return sum(length for _, length in _merge(clipped)) / size


def detection_probability(
    size: int, *, samples: int = DEFAULT_SAMPLES, sample_size: int = DEFAULT_SAMPLE_SIZE, changed_bytes: int = 1
) -> float:
    """The probability that a change to ``changed_bytes`` contiguous bytes at a uniformly random position is
    caught, i.e. overlaps a sampled range.

    1.0 for objects read whole. Otherwise a run of c bytes is caught when it starts inside one of the
    ``samples`` ranges or in the c - 1 bytes before one, so

        P = min(1, (samples * sample_size + (c - 1) * samples) / size)

    An approximation: it counts ``samples`` separate ranges where merged neighbours share an edge and the
    first range has no bytes before it, so it slightly overstates P for long runs.

    Example: a 100 GiB file with 64 x 1 MiB samples reads 64 MiB (0.0625%) and catches a single random
    flipped byte with probability 64 MiB / 100 GiB = 0.000625, a damaged 1 MiB run with probability
    (64 MiB + 64 MiB) / 100 GiB = 0.00125.
    Truncation, a wrong length and a damaged header or trailer are different: see the module docstring
    and ``block_damage_detection``.
    """
    _check(samples, sample_size)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if changed_bytes < 1:
        raise ValueError(f"changed_bytes must be >= 1, got {changed_bytes}")
    if size <= samples * sample_size:
        return 1.0
    return min(1.0, (samples * sample_size + (changed_bytes - 1) * samples) / size)


def block_damage_detection(
    size: int, damaged_fraction: float, samples: int = DEFAULT_SAMPLES, sample_size: int = DEFAULT_SAMPLE_SIZE
) -> float:
    """The probability that damage to a fraction ``f`` of the ``sample_size`` blocks, spread across the file,
    is caught: at least one of the k = ``samples`` sampled blocks is damaged,

        P = 1 - (1 - f) ** k

    Sampling with replacement; the real draw is without replacement, so this is a slight underestimate.
    1.0 for objects read whole (when anything is damaged). With the defaults:

        f = 0.1%: 0.062    f = 1%: 0.474    f = 5%: 0.962    f = 10%: 0.9988

    so 95% confidence needs f >= 1 - 0.05 ** (1 / k) (4.6% for k = 64); catching 0.1% damage with 95%
    confidence would take about 3,000 sampled blocks.
    """
    _check(samples, sample_size)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if not 0.0 <= damaged_fraction <= 1.0:
        raise ValueError(f"damaged_fraction must be in [0, 1], got {damaged_fraction}")
    if damaged_fraction == 0.0:
        return 0.0
    if size <= samples * sample_size:
        return 1.0
    return 1.0 - (1.0 - damaged_fraction) ** samples
