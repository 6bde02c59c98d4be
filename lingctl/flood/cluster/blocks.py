"""How a batch is cut into the blocks that engines answer.

A block keeps together what the answers depend on: the ``n`` answers and the prompts of one request, and every
request that could share a prompt prefix with another (prefix sharing reports ``cached_tokens`` in each answer's
usage, so two requests that share a prefix on one machine must share it in the cluster too). Requests can share
a prefix only if their first prompt chunk is the same (the prefix trie is built from whole chunks), so requests
are grouped by that chunk, and groups are packed whole, in batch order, into blocks of about the target size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lingctl.flood.engine.loop import GenRequest

MAX_BLOCK = 1024  # requests: large enough to keep an engine's batch full, small enough to lose little to a fault


@dataclass(slots=True)
class Block:
    index: int
    requests: list[GenRequest]


def block_size(requests: int, engines: int, max_seqs: int) -> int:
    """The default block: about four blocks per engine (a slow or lost engine then costs a quarter of its
    share), but at least two engine batches (``max_seqs``: a smaller block runs smaller, slower batches) unless
    that would leave an engine without a block, and at most ``MAX_BLOCK`` requests."""
    engines = max(1, engines)
    quarter = math.ceil(requests / (4 * engines))
    floor = min(2 * max_seqs, math.ceil(requests / engines))
    return max(1, min(MAX_BLOCK, max(quarter, floor)))


def make_blocks(requests: list[GenRequest], *, chunk: int, target: int) -> list[Block]:
    """``requests`` (keys ``(job, answer)``) cut into blocks of whole groups, in batch order (see the module)."""
    parent = list(range(len(requests)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_of: dict[object, int] = {}
    for i, req in enumerate(requests):
        keys: list[object] = [("job", req.key[0])]
        if len(req.prompt_ids) >= chunk:
            keys.append(("chunk", tuple(req.prompt_ids[:chunk])))
        for key in keys:
            j = first_of.setdefault(key, i)
            a, b = root(i), root(j)
            if a != b:
                parent[max(a, b)] = min(a, b)  # the group's root is its first request
    groups: dict[int, list[GenRequest]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(root(i), []).append(req)
    blocks: list[Block] = []
    current: list[GenRequest] = []
    for first in sorted(groups):
        current.extend(groups[first])
        if len(current) >= target:
            blocks.append(Block(len(blocks), current))
            current = []
    if current:
        blocks.append(Block(len(blocks), current))
    return blocks
