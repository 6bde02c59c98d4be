"""How ``--ray`` cuts a batch into blocks, and the in-order writing that makes a cluster's file the local one's.
Plain Python: no cluster needed."""

from __future__ import annotations

import functools

import pytest

from lingctl.flood.batch.in_order import InOrder
from lingctl.flood.cluster.blocks import MAX_BLOCK, block_size, make_blocks
from lingctl.flood.engine.loop import GenRequest
from lingctl.flood.engine.sampling import SamplingParams


def _req(job: int, answer: int, ids: list[int]) -> GenRequest:
    return GenRequest(key=(job, answer), prompt_ids=ids, sampling=SamplingParams(max_tokens=1))


def test_blocks_keep_a_request_s_answers_and_its_prefix_group_together() -> None:
    chunk = 4
    shared = [9, 9, 9, 9]
    reqs = [
        _req(0, 0, shared + [1]),
        _req(1, 0, [1, 2, 3, 4, 5]),
        _req(1, 1, [1, 2, 3, 4, 5]),  # request 1's second answer
        _req(2, 0, [7, 7]),  # shorter than a chunk: shares nothing
        _req(3, 0, shared + [2, 2]),  # shares request 0's first chunk
        _req(4, 0, [5, 6, 7, 8]),
        _req(4, 1, [6, 6, 6, 6]),  # request 4's second prompt (a prompt list), another first chunk
        _req(5, 0, [6, 6, 6, 6, 1]),  # shares that chunk: joins request 4
    ]
    blocks = make_blocks(reqs, chunk=chunk, target=2)
    where = {r.key: b.index for b in blocks for r in b.requests}
    assert sorted(where) == sorted(r.key for r in reqs)  # every request exactly once
    assert where[(0, 0)] == where[(3, 0)]
    assert where[(1, 0)] == where[(1, 1)]
    assert where[(4, 0)] == where[(4, 1)] == where[(5, 0)]
    assert len({where[(0, 0)], where[(1, 0)], where[(2, 0)], where[(4, 0)]}) >= 3  # the groups are spread
    # Blocks in batch order of their groups' first requests; each but the last reaches the target.
    firsts = [min(r.key[0] for r in b.requests) for b in blocks]
    assert firsts == sorted(firsts) and all(len(b.requests) >= 2 for b in blocks[:-1])


def test_the_default_block_is_a_quarter_of_an_engine_s_share_within_bounds() -> None:
    assert block_size(4_000, 2, 8) == 500
    assert block_size(2_000, 2, 256) == 512  # at least two full engine batches
    assert block_size(256, 2, 256) == 128  # but every engine gets a block
    assert block_size(10_000_000, 10, 8) == MAX_BLOCK


def test_answers_are_written_in_batch_order_whatever_order_they_finish_in() -> None:
    written: list[int] = []
    order = InOrder()
    for i in (2, 0, 3, 1, 4):
        order.put(i, functools.partial(written.append, i))
        assert written == list(range(len(written)))  # never a gap: each waits for all before it
    assert written == [0, 1, 2, 3, 4] and order.waiting == 0
    with pytest.raises(ValueError, match="already"):
        order.put(3, lambda: None)
