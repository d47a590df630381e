"""GPU-only checks of the CUDA attention backends (skipped without CUDA; run them on the first GPU you get).

    python -m pytest -q -s tests/test_gpu_attention.py      # -s prints the timing table

For every CUDA backend that is available here (``fa3``, ``flash_attn``, ``sdpa_cudnn``, ``sdpa_flash``,
``sdpa_efficient``, ``math``):

- the kernel pair (``attention_forward`` / ``attention_backward``) against the fp64 reference, causal
  and not, MHA and GQA, bf16/fp16 (flash-type kernels) and fp32 (efficient, math), including
  ``attention_backward`` with the merged-LSE contract ring attention relies on (the LSE of a larger
  softmax: a block of keys, with the LSE of the whole row) and the caller-provided gradient buffers;
- document masking (``local_attention(cu_seqlens=...)``: varlen kernels for fa3/flash_attn, one call
  per document otherwise) against the per-document fp64 reference;
- with 2 or more GPUs: Ulysses, zigzag Ring (the double-buffered flash path) and packed documents over
  NCCL against the reference;
- a timing table (forward + backward of one causal layer per backend; printed, not asserted).

Error measure: max-norm error relative to the reference's max-norm, and for half precision the RMS
error relative to that of PyTorch's own SDPA in the same dtype (bounded at 1.5x), the measure the CPU
suite uses for bf16 (a single element's error swings between seeds).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ALL_BACKENDS = ("fa3", "flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "math")
HALF = (torch.bfloat16, torch.float16)
#: fp32 kernels: max-norm relative error bound (TF32 is off in these tests).
FP32_TOL = 1e-4
#: half precision: RMS error at most this multiple of PyTorch SDPA's own RMS error in that dtype.
HALF_RATIO = 1.5


def _available(name: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when ``name`` can run ``dtype``/``head_dim`` on this GPU, else the reason."""
    from sp_plan.runtime.attention import kernel

    device = torch.device("cuda")
    major_minor = torch.cuda.get_device_capability(device)
    flash_shape = head_dim % 8 == 0 and head_dim <= kernel.FLASH_MAX_HEAD_DIM
    if name in ("fa3", "flash_attn", "sdpa_flash", "sdpa_cudnn") and dtype not in HALF:
        return f"{name} takes fp16/bf16 only"
    if name == "fa3":
        if not kernel.fa3_available():
            return "flash_attn_interface (FlashAttention-3) is not installed"
        if major_minor < kernel.FA3_MIN_CAPABILITY or not flash_shape:
            return f"FA3 needs compute capability >= 9.0 and head_dim % 8 == 0 (have {major_minor})"
    if name == "flash_attn" and (not kernel.flash_attn_available() or not flash_shape):
        return "flash-attn 2 is not installed"
    if name == "sdpa_cudnn" and (not kernel.cudnn_attention_available(device) or head_dim > kernel.CUDNN_MAX_HEAD_DIM):
        return "cuDNN attention needs cuDNN >= 9 and compute capability >= 9.0"
    if name == "sdpa_flash" and (major_minor < (8, 0) or not flash_shape):
        return "PyTorch's flash kernel needs compute capability >= 8.0"
    return None


def _inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim),
              (batch, seq, heads, head_dim)]
    return [torch.randn(s, generator=gen, device="cuda", dtype=torch.float64).to(dtype) for s in shapes]


def _reference(q, k, v, dout, causal, cu_seqlens=None):
    """fp64 out, dq, dk, dv (explicit mask: causal and, with cu_seqlens, same document)."""
    batch, seq, heads, head_dim = q.shape
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    group = heads // k.shape[2]
    kk, vv = (x.repeat_interleave(group, 2) for x in leaves[1:])
    scores = torch.einsum("bqhd,bkhd->bhqk", leaves[0], kk) / head_dim**0.5
    mask = torch.ones(batch, seq, seq, dtype=torch.bool, device=q.device)
    if causal:
        mask &= torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    if cu_seqlens is not None:
        doc = torch.zeros(batch * seq, dtype=torch.int64, device=q.device)
        doc[cu_seqlens[1:-1].long().to(q.device)] = 1
        doc = doc.cumsum(0).view(batch, seq)
        mask &= doc[:, :, None] == doc[:, None, :]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv)
    out.backward(dout.double())
    return [out.detach(), *(x.grad for x in leaves)]


def _sdpa(q, k, v, dout, causal):
    """PyTorch SDPA in the inputs' dtype (the half-precision yardstick)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in leaves), is_causal=causal, enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    return [out.detach(), *(x.grad for x in leaves)]


def _max_rel(actual, expected) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def _rms(actual, expected) -> float:
    return ((actual.double() - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def _check(name, dtype, results, expected, yardstick):
    for tensor, actual, ref, other in zip(("out", "dq", "dk", "dv"), results, expected, yardstick):
        if dtype in HALF:
            assert _rms(actual, ref) <= HALF_RATIO * _rms(other, ref) + 1e-6, (name, tensor, _rms(actual, ref),
                                                                             _rms(other, ref))
        else:
            assert _max_rel(actual, ref) <= FP32_TOL, (name, tensor, _max_rel(actual, ref))


@pytest.fixture(autouse=True)
def _no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("name", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_kernel_pair_matches_the_fp64_reference(name, dtype, causal, heads, kv_heads):
    from sp_plan.runtime.attention.kernel import attention_backward, attention_forward

    head_dim = 64
    reason = _available(name, dtype, head_dim)
    if reason:
        pytest.skip(reason)
    q, k, v, dout = _inputs(0, 2, 256, heads, kv_heads, head_dim, dtype)
    out, lse = attention_forward(q, k, v, causal=causal, backend=name)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))  # the ring's reused buffers
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal, backend=name, grads=grads)
    expected = _reference(q, k, v, dout, causal)
    _check(name, dtype, [out, dq, dk, dv], expected, _sdpa(q, k, v, dout, causal))
    assert lse.shape == (2, heads, 256) and lse.dtype == torch.float32


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_block_backward_with_the_merged_lse_of_a_larger_softmax(name):
    """Ring attention's contract: keys split in two blocks, each block's backward given the merged
    output and LSE of the whole row, sums to the full gradients."""
    from sp_plan.runtime.attention.kernel import attention_backward, attention_forward
    from sp_plan.runtime.attention.merge import merge_into

    dtype = torch.bfloat16 if name not in ("sdpa_efficient", "math") else torch.float32
    reason = _available(name, dtype, 64)
    if reason:
        pytest.skip(reason)
    q, k, v, dout = _inputs(1, 1, 256, 8, 2, 64, dtype)
    half = 128
    # queries 128..255 against keys 0..127 (fully visible) and 128..255 (causal diagonal)
    qs, dos = q[:, half:], dout[:, half:]
    out1, lse1 = attention_forward(qs, k[:, :half], v[:, :half], causal=False, backend=name)
    out2, lse2 = attention_forward(qs, k[:, half:], v[:, half:], causal=True, backend=name)
    out, lse = out1.float(), lse1.clone()
    merge_into(out, lse, out2, lse2)  # the merged output and LSE of the whole row, as the ring has them
    out = out.to(dtype)
    dq1, _, _ = attention_backward(dos, qs, k[:, :half], v[:, :half], out, lse, causal=False, backend=name)
    dq2, dk2, dv2 = attention_backward(dos, qs, k[:, half:], v[:, half:], out, lse, causal=True, backend=name)
    expected = _reference(q, k, v, dout, True)
    bound = 3e-2 if dtype in HALF else 1e-5
    # Queries 128..255 are the only ones that see keys 128..255, so those keys' gradients are complete;
    # keys 0..127 also get gradient from queries 0..127, which this test does not compute.
    assert _rms(out, expected[0][:, half:]) < bound
    assert _rms(dq1.double() + dq2.double(), expected[1][:, half:]) < bound
    assert _rms(dk2, expected[2][:, half:]) < bound
    assert _rms(dv2, expected[3][:, half:]) < bound


@pytest.mark.parametrize("name", ALL_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_document_masking_matches_per_document_attention(name, causal):
    from sp_plan.runtime.attention import local_attention

    dtype = torch.bfloat16 if name not in ("sdpa_efficient", "math") else torch.float32
    reason = _available(name, dtype, 64)
    if reason:
        pytest.skip(reason)
    seq = 256
    cu = torch.tensor([0, 1, 37, 100, 101, 256, 256 + 200, 512], dtype=torch.int32)
    q, k, v, dout = _inputs(2, 2, seq, 8, 2, 64, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_attention(*leaves, causal=causal, backend=name, cu_seqlens=cu)
    out.backward(dout)
    expected = _reference(q, k, v, dout, causal, cu)
    results = [out.detach(), *(x.grad for x in leaves)]
    for tensor, actual, ref in zip(("out", "dq", "dk", "dv"), results, expected):
        bound = 3e-2 if dtype in HALF else 1e-5
        assert _rms(actual, ref) < bound, (name, tensor, _rms(actual, ref))


def _nccl_rank(rank: int, world: int, layout: str, packed: bool) -> dict:
    from sp_plan.cost_models.layout import Layout
    from sp_plan.runtime.context import SequenceParallel
    from sp_plan.runtime.mesh import build_mesh

    mesh = build_mesh(Layout(ring=world if layout == "ring" else 1, ulysses=world if layout == "ulysses" else 1),
                      device_type="cuda")
    sp = SequenceParallel.from_mesh(mesh)
    seq = 512 * world
    cu = torch.tensor([0, 3, 700, seq - 5, seq, seq + 900, 2 * seq], dtype=torch.int32) if packed else None
    errors = {}
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, dout = _inputs(5, 2, seq, 8, 2, 64, dtype)
        expected = [sp.shard(e) for e in _reference(q, k, v, dout, True, cu)]
        leaves = [sp.shard(x).clone().requires_grad_() for x in (q, k, v)]
        out = sp.attention(*leaves, causal=True, cu_seqlens=cu)
        out.backward(sp.shard(dout))
        results = [out.detach(), *(x.grad for x in leaves)]
        errors[str(dtype)] = [_rms(a, e) for a, e in zip(results, expected)]
    return errors


@pytest.mark.parametrize("layout", ["ulysses", "ring"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_multi_gpu_paths_over_nccl(layout, packed):
    from tests.distributed import run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for errors in run_ranks(2, _nccl_rank, layout, packed, backend="nccl", timeout=300):
        assert max(errors["torch.bfloat16"]) < 3e-2 and max(errors["torch.float32"]) < 1e-4, errors


def test_timing_table(capsys):
    """Forward + backward of one causal layer per available backend (median of 10; printed)."""
    from sp_plan.runtime.attention.kernel import attention_backward, attention_forward

    rows = []
    for name in ALL_BACKENDS:
        dtype = torch.bfloat16 if name not in ("sdpa_efficient", "math") else torch.float32
        if _available(name, dtype, 128):
            continue
        seq = 8192 if name != "math" else 2048
        q, k, v, dout = _inputs(3, 1, seq, 16, 4, 128, dtype)
        times = []
        for _ in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out, lse = attention_forward(q, k, v, causal=True, backend=name)
            attention_backward(dout, q, k, v, out, lse, causal=True, backend=name)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        median = sorted(times[2:])[len(times[2:]) // 2]
        flops = 4 * 16 * 128 * seq * (seq + 1) / 2 * (1 + 2.5)  # forward 4, backward 10 FLOPs per pair and dim
        rows.append(f"| {name} | {str(dtype).removeprefix('torch.')} | {seq} | {median * 1e3:.2f} | "
                    f"{flops / median / 1e12:.1f} |")
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name()}: causal, batch 1, 16 heads / 4 KV heads, head_dim 128")
        print("| backend | dtype | seq | fwd+bwd ms | TFLOP/s |\n|---|---|---|---|---|")
        print("\n".join(rows))
    assert rows
