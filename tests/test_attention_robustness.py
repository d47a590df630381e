"""Issue 16, "nothing lost, nothing silent": hostile inputs to the public attention entry points.

Each test reproduces a defect and failed before its fix:

- a zero-length sequence killed the process with SIGFPE inside the CPU flash kernel (run in a
  subprocess here, so a crash fails the test instead of killing pytest); zero heads or head_dim raised
  ZeroDivisionError; Ulysses with length 0 raised an unrelated custom-op error;
- ranks that agreed on call 1 and disagreed on call 2 hung until the process-group timeout (the
  agreement check was cached per rank and shape): now every call checks, and every rank raises within
  seconds;
- one rank with a local problem (bad scale, wrong rank tensor) raised alone and left its peers waiting;
- NaN in q came out as 0 on CPU (the CPU flash kernel drops NaN scores; ring attention's first block
  also zeroed non-finite LSE rows); a scale <= 0 gave NaN output unchecked.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch

from sp_plan.runtime.attention import local_attention, reference_attention
from sp_plan.runtime.errors import RuntimeConfigError
from tests.distributed import run_ranks


def _error(fn, *args, **kwargs) -> str | None:
    """The RuntimeConfigError message of ``fn(*args, **kwargs)``, or None if it returns (other types propagate)."""
    try:
        fn(*args, **kwargs)
    except RuntimeConfigError as exc:
        return str(exc)
    return None


# ----- single process -------------------------------------------------------------------------------


def test_zero_length_sequence_is_refused_before_the_kernel_runs_in_a_subprocess():
    """Before: SIGFPE (exit -8) inside aten._scaled_dot_product_flash_attention_for_cpu."""
    code = (
        "import torch\n"
        "from sp_plan.runtime.attention import local_attention\n"
        "from sp_plan.runtime.errors import RuntimeConfigError\n"
        "q = torch.randn(1, 0, 2, 4)\n"
        "try:\n"
        "    local_attention(q, q, q, causal=True)\n"
        "except RuntimeConfigError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "REFUSED attention got an empty q (1, 0, 2, 4)" in done.stdout, done.stdout


@pytest.mark.parametrize("shape", [(0, 8, 2, 4), (1, 8, 0, 4), (1, 8, 2, 0)])  # seq 0: the subprocess test above
def test_every_empty_dimension_is_one_clear_error(shape):
    q = torch.randn(shape)
    for causal in (True, False):
        message = _error(local_attention, q, q, q, causal=causal)
        assert message is not None and "empty q" in message and str(shape) in message, message


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, -math.inf, "0.5", True])
def test_a_scale_that_is_not_finite_and_positive_is_refused(scale):
    q = torch.randn(1, 8, 2, 4)
    for backend in ("sdpa_cpu_flash", "math"):
        message = _error(local_attention, q, q, q, scale=scale, backend=backend)
        assert message is not None and "scale" in message, (scale, backend, message)


def _hostile_cases():
    q = torch.randn(1, 8, 4, 8)
    kv = torch.randn(1, 8, 2, 8)
    return {
        "3-D q": ((q[0], kv, kv), {}, "4-D"),
        "5-D k": ((q, kv[None], kv[None]), {}, "4-D"),
        "not a tensor": ((q.tolist(), kv, kv), {}, "torch.Tensor"),
        "dtype mix": ((q, kv.double(), kv.double()), {}, "dtypes differ"),
        "integer": ((q.long(), kv.long(), kv.long()), {}, "floating-point"),
        "device mix": ((q, kv.to("meta"), kv.to("meta")), {}, "different devices"),
        "head_dim": ((q, torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4)), {}, "head_dim"),
        "batch": ((q, torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8)), {}, "batch"),
        "k vs v": ((q, kv, torch.randn(1, 8, 1, 8)), {}, "same shape"),
        "gqa": ((q, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8)), {}, "multiple of 3 KV heads"),
        "causal rectangle": ((q, kv[:, :4], kv[:, :4]), {"causal": True}, "as many queries as keys"),
    }


@pytest.mark.parametrize("case", sorted(_hostile_cases()))
def test_hostile_inputs_to_local_attention_give_the_project_error(case):
    args, kwargs, needle = _hostile_cases()[case]
    message = _error(lambda: local_attention(*args, **kwargs))
    assert message is not None and needle in message, (case, message)


def test_non_contiguous_inputs_and_partial_requires_grad_are_exact():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1, 4, 8, 8, generator=gen, dtype=torch.float64)
    q = base.transpose(1, 2)  # (1, 8, 4, 8), non-contiguous
    k = torch.randn(1, 8, 8, 4, generator=gen, dtype=torch.float64)[..., :2, :].transpose(2, 3)  # stride games
    k = k.reshape(1, 8, 2, 4).repeat(1, 1, 1, 2)  # (1, 8, 2, 8)
    v = torch.randn(1, 8, 2, 16, generator=gen, dtype=torch.float64)[..., ::2]  # last dim strided
    assert not q.is_contiguous() and not v.is_contiguous()
    leaf = q.detach().clone().requires_grad_()  # only q requires grad
    out = local_attention(leaf.transpose(1, 2).transpose(1, 2), k, v, causal=True)
    out.square().sum().backward()
    ref_leaf = q.detach().clone().requires_grad_()
    ref, _ = reference_attention(ref_leaf, k, v, causal=True)
    ref.square().sum().backward()
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(leaf.grad, ref_leaf.grad, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa_cpu_flash", "math"])
def test_nan_in_q_propagates_to_its_row_and_nothing_else(backend):
    """Before: the CPU flash kernel returned output 0 and LSE 0 for a query row holding a NaN."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=gen) for _ in range(3))
    clean = local_attention(q, k, v, causal=True, backend=backend)
    q[0, 3, 1, 2] = float("nan")
    out, lse = local_attention(q, k, v, causal=True, backend=backend, return_lse=True)
    bad = torch.zeros(1, 8, 2, dtype=torch.bool)
    bad[0, 3, 1] = True
    assert out[bad].isnan().all() and lse.transpose(1, 2)[bad].isnan().all(), out[0, 3]
    assert torch.equal(out[~bad], clean[~bad])
    q[0, 3, 1, 2] = float("inf")  # inf scores give inf - inf = NaN in exact attention too
    assert local_attention(q, k, v, causal=True, backend=backend)[bad].isnan().all()


# ----- several ranks --------------------------------------------------------------------------------


def _path_call(path: str, q, k, v, **kwargs):
    import torch.distributed as dist

    from sp_plan.runtime.attention import ring_attention, ulysses_attention

    group = dist.group.WORLD
    if path == "ulysses":
        return ulysses_attention(q, k, v, group, **kwargs)
    if path == "ring":
        return ring_attention(q, k, v, group, layout="zigzag", **kwargs)
    from tests.attention_checks import sp_context

    world = dist.get_world_size()
    sp = sp_context(world, ring=2, ulysses=world // 2)
    return sp.attention(q, k, v, **kwargs)


def _call_and_backward(path: str, q: torch.Tensor) -> None:
    out = _path_call(path, q, q, q, causal=True)
    if out.requires_grad:
        out.sum().backward()


def _agree_then_disagree_rank(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    results: dict = {"seconds": []}
    heads = 4
    for call, local in enumerate((8, 4 if rank == world - 1 else 8, 8 if rank == 0 else 4)):
        q = torch.randn(1, local, heads, 8, requires_grad=True)
        dist.barrier()  # time the call, not a peer still importing or building its mesh
        start = time.monotonic()
        message = _error(_call_and_backward, path, q)
        results["seconds"].append(time.monotonic() - start)
        results[call] = message
    return results


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path,world", [("ulysses", 2), ("ring", 2), ("ring", 3), ("usp", 4)])
def test_ranks_that_agree_once_and_disagree_later_raise_on_every_rank_and_never_hang(path, world):
    """Before: call 2 hung until the process-group timeout (the cached check ran on some ranks only)."""
    for rank, r in enumerate(run_ranks(world, _agree_then_disagree_rank, path, timeout=90)):
        assert r[0] is None, (rank, r[0])
        for call in (1, 2):
            assert r[call] is not None, (rank, call, "no error")
            # USP: the disagreeing Ulysses group says so; its ring peers name the rank that stopped.
            assert "disagree on their local shapes" in r[call] or "refused their inputs" in r[call], r[call]
            assert "holds q (1, 4, 4, 8)" in r[call] or "holds q (1, 8, 4, 8)" in r[call], r[call]
            assert r["seconds"][call] < 10, (rank, r["seconds"])


def _one_rank_hostile_rank(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    good = torch.randn(1, 8, 4, 8)
    hostile = {
        "nan scale": ((good, good, good), {"scale": math.nan if rank == 1 else None}),
        "3-D q": ((good[0] if rank == 1 else good, good, good), {}),
        "not a tensor": ((good.tolist() if rank == 1 else good, good, good), {}),
        "empty": ((good[:, :0] if rank == 1 else good, good[:, :0] if rank == 1 else good, good), {}),
        "empty everywhere": ((good[:, :0], good[:, :0], good[:, :0]), {}),
        "heads": ((torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8)), {}),
        "dtype": ((good.double() if rank == 1 else good, good, good), {}),
        "scale differs": ((good, good, good), {"scale": 0.5 if rank == 1 else 0.25}),
    }
    if path == "ring":
        del hostile["heads"]  # any head count works for ring attention
    out = {}
    for name, (args, kwargs) in hostile.items():
        dist.barrier()  # time the call, not a peer still importing or building its mesh
        start = time.monotonic()
        out[name] = (_error(_path_call, path, *args, causal=True, **kwargs), time.monotonic() - start)
    if path == "ring":  # (USP's ring-local sequence is U local shards long: even for U = 2)
        odd = torch.randn(1, 3, 4, 8)
        out["odd zigzag"] = (_error(lambda: _path_call(path, odd, odd, odd, causal=True)), 0.0)
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path,world", [("ulysses", 2), ("ring", 2), ("usp", 4)])
def test_a_problem_on_one_rank_raises_on_every_rank_without_waiting(path, world):
    """Before: the rank with the problem raised alone and its peers waited in a collective (or gloo aborted)."""
    needles = {"nan scale": "scale", "3-D q": "4-D", "not a tensor": "torch.Tensor", "empty": "empty",
               "empty everywhere": "empty", "dtype": "dtype", "scale differs": "scale"}
    for rank, r in enumerate(run_ranks(world, _one_rank_hostile_rank, path, timeout=100)):
        for name, (message, seconds) in r.items():
            assert message is not None, (path, rank, name, "no error")
            assert seconds < 10, (path, rank, name, seconds)
            if name in needles:
                assert needles[name] in message or "refused their inputs" in message, (rank, name, message)
        if path != "ring":
            assert "ulysses=2 does not divide 3 query heads" in r["heads"][0], r["heads"]
        if path == "ring":
            assert "even local sequence" in r["odd zigzag"][0], r["odd zigzag"]


def _nan_rank(rank: int, world: int, path: str) -> dict:
    from tests.attention_checks import sp_context

    sp = sp_context(world, ring=world if path == "ring" else 1, ulysses=world if path == "ulysses" else 1)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, 4, 8, generator=gen) for _ in range(3))
    q[0, 1, 2, 3] = float("nan")  # position 1: ring rank 0's first chunk, which no later ring step merges into
    local = [sp.shard(x) for x in (q, k, v)]
    out = sp.attention(*local, causal=True)
    positions = sp.positions(16)
    return {"nan": out.isnan().any(-1).nonzero().tolist(), "positions": positions.tolist()}


@pytest.mark.multiproc
@pytest.mark.parametrize("path", ["ring", "ulysses"])
def test_nan_in_q_comes_out_as_nan_through_the_parallel_paths(path):
    """Before: 0 (the CPU kernel, and ring attention's first block zeroed rows with a non-finite LSE)."""
    found = []
    for r in run_ranks(2, _nan_rank, path, timeout=60):
        found += [(r["positions"][row], head) for _, row, head in r["nan"]]
    assert found == [(1, 2)], found


# ----- shard and the data path ----------------------------------------------------------------------


def test_shard_and_batch_sharder_refuse_empty_and_malformed_input():
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.data import BatchSharder

    sp = SequenceParallel()
    for bad, needle in (((torch.zeros(2, 0, 3), 1), "positive integer"), ((torch.zeros(2, 8), 2), "cannot shard dim"),
                        ((torch.zeros(()), 0), "cannot shard"), (([1, 2], 1), "torch.Tensor")):
        message = _error(sp.shard, *bad)
        assert message is not None and needle in message, (bad, message)
    for ids in (torch.zeros(0, 8, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        message = _error(BatchSharder(sp), ids)
        assert message is not None and "empty batch" in message, message


def _grad_skew_rank(rank: int, world: int, path: str) -> str | None:
    q = torch.randn(1, 8, 4, 8, requires_grad=rank == 0)  # only rank 0 will run the backward collectives
    return _error(_call_and_backward, path, q)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["ulysses", "ring"])
def test_ranks_that_disagree_on_requires_grad_are_stopped_in_the_forward(path):
    """Before: rank 0 ran the backward's collectives alone and waited for rank 1 until the timeout."""
    for message in run_ranks(2, _grad_skew_rank, path, timeout=60):
        assert message is not None and "requires_grad" in message, message
