"""The multi-rank harness itself: results in rank order, the failing rank's traceback, the timeout."""

from __future__ import annotations

import time

import pytest

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc


def _sum_ranks(rank: int, world: int, offset: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return rank, int(t)


def _rank_one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken on purpose")


def _rank_zero_hangs(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_results_come_back_in_rank_order():
    assert run_ranks(2, _sum_ranks, 10) == [(0, 21), (1, 21)]


def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(AssertionError) as info:
        run_ranks(2, _rank_one_fails)
    text = str(info.value)
    assert "--- rank 1 failed ---" in text and "ValueError: rank one is broken on purpose" in text
    assert "_rank_one_fails" in text


def test_a_hanging_rank_times_out():
    start = time.monotonic()
    # Rank 1 returns but then waits for rank 0 at the harness's final barrier: both are reported.
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 5 s"):
        run_ranks(2, _rank_zero_hangs, timeout=5)
    assert time.monotonic() - start < 15
