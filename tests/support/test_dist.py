"""The gloo helper later tools' tests use: real process groups on 127.0.0.1."""

from __future__ import annotations

import pytest

from tests.support.dist import run_workers


def _all_reduce(rank: int, world_size: int, base: float) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return dist.get_rank(), float(t.item())


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one failed")


@pytest.mark.slow
def test_all_reduce_across_two_processes() -> None:
    assert run_workers(_all_reduce, 2, 10.0) == [(0, 21.0), (1, 21.0)]


@pytest.mark.slow
def test_worker_failure_is_reported() -> None:
    with pytest.raises(Exception, match="rank one failed"):
        run_workers(_fail_on_rank_one, 2, timeout=60)
