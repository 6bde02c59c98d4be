"""Prefix sharing: find token prefixes common to several requests of the batch, so each is prefilled once,
stored once in the KV cache, and read by every request that starts with it.

The batch is known up front (offline inference), so instead of hashing blocks as they are computed (vLLM's
automatic prefix caching) the whole batch is put in a trie of fixed-size token blocks before anything runs.
A request shares the deepest trie node that at least one other request also passes through. Nested prefixes
(a system prompt, then a few-shot block used by some of the requests) become a chain of entries, each
storing only the tokens past its parent.

Blocks are the engine's prompt-chunk size, so a request's own chunks start at the same positions with or
without sharing, which keeps outputs identical either way (see forward.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixEntry:
    index: int
    parent: int | None  # entry whose tokens precede this one's
    start: int  # position of this entry's first token
    tokens: list[int]  # this entry's own tokens (positions start .. start + len - 1)
    users: int = 0  # requests whose deepest shared prefix is this entry or a descendant

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(slots=True)
class PrefixPlan:
    entries: list[PrefixEntry] = field(default_factory=list)
    of_request: list[int | None] = field(default_factory=list)  # deepest entry per request

    def shared_tokens(self, request: int) -> int:
        entry = self.of_request[request]
        return 0 if entry is None else self.entries[entry].end

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens not prefilled thanks to sharing (each entry is computed once)."""
        used = sum(self.shared_tokens(i) for i in range(len(self.of_request)))
        return used - sum(len(e.tokens) for e in self.entries)

    def chain(self, entry: int | None) -> list[int]:
        """Entries from the root to ``entry``, in position order."""
        out: list[int] = []
        while entry is not None:
            out.append(entry)
            entry = self.entries[entry].parent
        return out[::-1]


class _Node:
    __slots__ = ("children", "count", "depth", "entry")

    def __init__(self, depth: int) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.count = 0
        self.depth = depth  # blocks from the root
        self.entry: int | None = None


def plan_prefixes(prompts: list[list[int]], block: int, *, min_users: int = 2) -> PrefixPlan:
    """Entries for every block-aligned prefix that at least ``min_users`` prompts share. A prompt always
    keeps its last token for itself: its logits are needed to sample the first output token."""
    if block < 1:
        raise ValueError(f"prefix block must be >= 1, got {block}")
    root = _Node(0)
    paths: list[list[_Node]] = []
    for ids in prompts:
        node, path = root, []
        for b in range((len(ids) - 1) // block):
            key = tuple(ids[b * block : (b + 1) * block])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node.depth + 1)
            child.count += 1
            path.append(child)
            node = child
        paths.append(path)
    plan = PrefixPlan()
    deepest: list[_Node | None] = []
    for path in paths:
        shared = [n for n in path if n.count >= min_users]
        deepest.append(shared[-1] if shared else None)
    # Entry boundaries: every request's deepest shared node, and every shared node where shared paths
    # branch; a chain of shared nodes without a branch is one entry, so nested prefixes are stored once.
    deep_ids = {id(n) for n in deepest if n is not None}

    def boundary(n: _Node) -> bool:
        if id(n) in deep_ids:
            return True
        return sum(1 for c in n.children.values() if c.count >= min_users) != 1

    for ids, path, deep in zip(prompts, paths, deepest):
        if deep is None:
            plan.of_request.append(None)
            continue
        parent: int | None = None
        prev_depth = 0
        for n in path[: deep.depth]:
            if not boundary(n):
                continue
            if n.entry is None:
                n.entry = len(plan.entries)
                plan.entries.append(
                    PrefixEntry(
                        index=n.entry,
                        parent=parent,
                        start=prev_depth * block,
                        tokens=list(ids[prev_depth * block : n.depth * block]),
                    )
                )
            parent, prev_depth = n.entry, n.depth
            plan.entries[n.entry].users += 1
        plan.of_request.append(deep.entry)
    return plan
