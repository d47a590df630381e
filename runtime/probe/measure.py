"""Micro-benchmarks with torch: matmul and attention FLOP/s, memory copy bandwidth, and collectives.

Every timing is a median over repetitions, taken after warm-up, and collectives report the slowest
rank's median (a collective is as slow as its last rank). Budgets keep the CPU probe to seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sp_plan.cost_models.link_fit import TimingSample

#: Matmul sizes: large enough to reach steady-state throughput, small enough for a CPU budget (a CPU
#: GEMM reaches its rate from about 128 x 128 up; measured on a 2-core EPYC: 512^3 and 2048 x 128 x 128
#: run within 2% of each other in fp32 and bf16).
MATMUL_SIZE = {"cuda": 8192, "cpu": 512}
#: Attention benchmark shape (batch, heads, seq, head_dim) per device kind. On CPU, long enough that
#: aten's flash kernel runs several of its 512-key blocks per query block (its shape dependence is the
#: kernel model's business: the probe reports the asymptotic rate, see build.py).
ATTENTION_SHAPE = {"cuda": (1, 16, 8192, 128), "cpu": (1, 4, 1024, 64)}
#: Bytes copied to measure memory bandwidth.
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 26}
#: Untimed calls before timing: the first CPU GEMM after a thread-count change builds OpenMP's pool and
#: MKL/oneDNN pick and pack their kernels over the first calls.
WARMUP_CALLS = {"cuda": 1, "cpu": 3}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _concurrent(device: torch.device) -> bool:
    """CPU ranks of one job share the host's cores: their compute timings must overlap, as in training.
    Only CPU ranks (a gloo group): GPU ranks' host-side copies stay per rank, and NCCL could not reduce
    the CPU tensors that agree on repetition counts."""
    return (device.type == "cpu" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() == "gloo")


def _median_time(fn: Callable[[], object], device: torch.device, budget_s: float, min_reps: int = 3,
                 max_reps: int = 50) -> float:
    """Seconds per call of ``fn`` after warm-up.

    GPUs: the median call, repetitions running until ``budget_s`` is spent. CPUs: throughput over
    windows of calls (:func:`_cpu_time`), all ranks at once when there are several.
    """
    for _ in range(WARMUP_CALLS[device.type]):
        fn()
    synchronize(device)
    if device.type == "cpu":
        return _cpu_time(fn, device, budget_s, min_reps, max_reps)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


#: Windows a CPU timing is split into; the median window is kept, so a burst of other jobs' load during one
#: window (a quick probe's window is tens of milliseconds) does not set the rate.
CPU_WINDOWS = 3


def _cpu_time(fn: Callable[[], object], device: torch.device, budget_s: float, min_reps: int,
              max_reps: int) -> float:
    """Seconds per call of ``fn`` on CPU: the throughput a rank gets, all CPU ranks at once (a collective
    call when there are several).

    Two traps make a per-call median wrong on CPU. A rank timed while the others wait has a core to itself
    and overstates its training share, so every rank agrees on one repetition count (from the slowest
    rank's single call) and starts after a barrier. And with more ranks (or OpenMP threads) than free
    cores the scheduler hands out time slices of a few milliseconds: a call shorter than a slice either
    runs untouched at a whole core's speed or waits a whole slice, so per-call times are bimodal and their
    median lands on either mode (a 4-rank probe once reported fp32 GEMMs at a tenth of the bf16 rate
    for this reason). The throughput is a loop's wall time over its calls, and with several ranks the
    slowest rank's loop, the one training waits for. The calls run in :data:`CPU_WINDOWS`
    (barrier-aligned) windows; the median window's figure is returned.
    """
    together = _concurrent(device)
    if together:
        dist.barrier()
    start = time.perf_counter()
    fn()
    single = time.perf_counter() - start
    if together:
        single = _slowest(single, None, device)
    reps = int(min(max_reps, max(min_reps, budget_s / max(single, 1e-6))))
    per_window = max(1, -(-reps // CPU_WINDOWS))
    seconds = []
    for _ in range(CPU_WINDOWS):
        if together:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(per_window):
            fn()
        seconds.append((time.perf_counter() - start) / per_window)
    if together:
        slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = slowest.tolist()
    return statistics.median(seconds)


def matmul_flops(device: torch.device, dtype: torch.dtype, budget_s: float) -> float:
    n = MATMUL_SIZE[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _median_time(lambda: torch.mm(a, b), device, budget_s)
    return 2.0 * n**3 / seconds


def attention_flops(device: torch.device, dtype: torch.dtype, budget_s: float) -> tuple[float, float]:
    """Causal scaled-dot-product attention forward and backward FLOP/s at :data:`ATTENTION_SHAPE` (the
    model's flash counting: 4 b h d pairs forward with causal pairs S(S+1)/2, backward 2.5x forward).

    On CPU this runs aten's ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, the
    kernels the runtime's attention calls there."""
    b, h, s, d = ATTENTION_SHAPE[device.type]
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    fwd_flops = 4.0 * b * h * d * s * (s + 1) / 2

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        t_fwd = _median_time(forward, device, budget_s / 2)
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

    def both() -> None:
        out = forward()
        out.backward(grad)

    t_both = _median_time(both, device, budget_s / 2)
    t_bwd = max(t_both - t_fwd, 1e-9)
    return fwd_flops / t_fwd, 2.5 * fwd_flops / t_bwd


def copy_bandwidth(device: torch.device, budget_s: float) -> float:
    """Device memory bandwidth: a copy reads and writes every byte."""
    n = COPY_BYTES[device.type] // 4
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), device, budget_s)
    return 2.0 * n * 4 / seconds


def host_to_device_bandwidth(device: torch.device, budget_s: float) -> float:
    n = COPY_BYTES["cuda"] // 4
    src = torch.ones(n, dtype=torch.float32).pin_memory()
    dst = torch.empty(n, device=device, dtype=torch.float32)
    seconds = _median_time(lambda: dst.copy_(src, non_blocking=True), device, budget_s)
    return n * 4 / seconds


# ----- collectives ---------------------------------------------------------------------------------


def _slowest(value: float, group, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_collectives(group, group_ranks: Sequence[int], sizes: Sequence[int], device: torch.device,
                        budget_s: float, collectives: Sequence[str] = ("all_reduce", "all_to_all", "send_recv"),
                        ) -> list[TimingSample]:
    """Time each collective at each size on ``group`` (every rank of the group calls this together).

    Sizes are the collective's size argument in bytes (see sp_plan.cost_models.collectives). Ranks in other
    groups run theirs at the same time, so shared links are loaded as in training.
    """
    p = len(group_ranks)
    me = group_ranks.index(dist.get_rank())
    nxt, prv = group_ranks[(me + 1) % p], group_ranks[(me - 1) % p]
    samples: list[TimingSample] = []
    per_op_budget = budget_s / max(1, len(sizes) * len(collectives))
    for collective in collectives:
        for nbytes in sizes:
            elems = max(p, nbytes // 4 // p * p)
            buf = torch.ones(elems, dtype=torch.float32, device=device)
            out = torch.empty_like(buf)
            if collective == "all_reduce":
                def run(buf=buf) -> None:
                    dist.all_reduce(buf, group=group)
            elif collective == "all_to_all":
                def run(buf=buf, out=out) -> None:
                    dist.all_to_all_single(out, buf, group=group)
            elif collective == "send_recv":
                def run(buf=buf, out=out) -> None:
                    ops = [dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()
            else:
                raise ValueError(f"unsupported collective {collective}")
            dist.barrier(group=group)
            seconds = _median_time_collective(run, group, device, per_op_budget)
            samples.append(TimingSample(collective=collective, group_size=p, nbytes=float(elems * 4),
                                        seconds=max(seconds, 1e-9)))
    return samples


def _median_time_collective(run: Callable[[], None], group, device: torch.device, budget_s: float) -> float:
    """Median over a fixed repetition count agreed by all ranks (every rank must call run() equally)."""
    run()
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    single = _slowest(time.perf_counter() - start, group, device)
    reps = int(min(50, max(3, budget_s / max(single, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return _slowest(statistics.median(times), group, device)
