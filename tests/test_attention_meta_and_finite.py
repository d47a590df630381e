"""Issue 35 item 6: meta-device tensors given to sequence-parallel attention (which must exchange data) are one
clear RuntimeConfigError on every rank, not a raw gloo RuntimeError; NaN inputs pass through as with any kernel
unless ``SP_PLAN_CHECK_FINITE=1`` asks every call to refuse them."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks


def _error(fn) -> str | None:
    from sp_plan.runtime.errors import RuntimeConfigError

    try:
        fn()
    except RuntimeConfigError as exc:
        return str(exc)
    return None


def _meta_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from sp_plan.runtime.attention import ring_attention, ulysses_attention

    group = dist.group.WORLD
    q = torch.empty(1, 8, 4, 8, device="meta") if rank == 0 else torch.randn(1, 8, 4, 8)
    return {"ulysses": _error(lambda: ulysses_attention(q, q, q, group)),
            "ring": _error(lambda: ring_attention(q, q, q, group, causal=True, layout="zigzag"))}


@pytest.mark.multiproc
def test_meta_tensors_are_refused_on_every_rank():
    for rank, result in enumerate(run_ranks(2, _meta_rank, timeout=60)):
        for path, message in result.items():
            assert message is not None, (rank, path)
            if rank == 0:
                assert "meta device" in message and "to_empty" in message, message
            else:
                assert "rank(s) 0" in message, message


def test_nan_inputs_are_refused_only_when_asked(monkeypatch):
    from sp_plan.runtime.attention import local_attention
    from sp_plan.runtime.attention.groups import CHECK_FINITE_ENV
    from sp_plan.runtime.errors import RuntimeConfigError

    q = torch.randn(1, 8, 2, 4)
    k = q.clone()
    k[0, 3, 1, 2] = float("nan")
    monkeypatch.delenv(CHECK_FINITE_ENV, raising=False)
    assert torch.isnan(local_attention(q, k, q)).any()  # the default: as any attention kernel
    monkeypatch.setenv(CHECK_FINITE_ENV, "1")
    with pytest.raises(RuntimeConfigError, match=r"k hold NaN or infinite"):
        local_attention(q, k, q)
    assert torch.isfinite(local_attention(q, q, q)).all()


def test_meta_tensors_on_one_process_still_give_shapes():
    from sp_plan.runtime.attention import local_attention

    q = torch.empty(2, 8, 4, 16, device="meta")
    assert local_attention(q, q, q).shape == (2, 8, 4, 16)
