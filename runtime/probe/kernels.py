"""Time the GEMMs and attention calls the planner prices, on this machine's device (``sp-plan probe --kernels``).

The shapes come from :func:`sp_plan.planner.fitting.probe_fit.probe_shapes` (a model's layer at each sequence
length and layout); each is timed with the probe's helpers (:func:`sp_plan.runtime.probe.measure._median_time`:
warm-up, then the median call on GPUs, windowed throughput on CPUs). GEMMs run ``torch.mm`` in the probe's
dtype. Attention runs the runtime's own kernel entry points
(:func:`sp_plan.runtime.attention.kernel.attention_forward` / ``attention_backward``) on the backend that
implements the kernel family the stack is priced with on this GPU
(:func:`sp_plan.cost_models.stack.attention_kernel_for`): ``fa2`` -> the flash-attn package when it imports,
else PyTorch's flash SDPA (a FlashAttention-2 port); ``fa3`` -> FlashAttention-3 (``flash_attn_interface``);
``cudnn`` -> PyTorch's cuDNN SDPA. On CPU: aten's CPU flash kernel, the one the runtime calls there.

The total time is bounded: shapes run smallest first, each is skipped when its predicted cost (the
planner's own prediction, corrected by the median measured/predicted ratio of the kernels of its kind timed
so far) would overrun the budget.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from sp_plan.cost_models.errors import CostModelError
from sp_plan.planner.fitting.probe_fit import (
    AttentionShape,
    GemmShape,
    KernelPredictor,
    KernelTiming,
    PlannedKernel,
)
from sp_plan.runtime.attention import kernel as attention_kernel

from . import measure

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Calls a timing makes at least (warm-up, the CPU helper's sizing call, its three windows; GPUs: warm-up and
#: three repetitions): what a shape costs beyond its share of the budget.
MIN_CALLS = {"cpu": measure.WARMUP_CALLS["cpu"] + 1 + measure.CPU_WINDOWS, "cuda": measure.WARMUP_CALLS["cuda"] + 3}
#: The share of what is left of the budget a timing may spend on repetitions beyond its minimum.
REPETITION_SHARE = 0.5
#: Bytes of operands one timing may allocate (a long sequence's Q/K/V at many heads on a small GPU).
MAX_OPERAND_BYTES = {"cpu": 1 << 30, "cuda": 16 << 30}


@dataclass
class KernelProbe:
    timings: list[KernelTiming]
    skipped: list[PlannedKernel] = field(default_factory=list)
    backend: str = ""
    device: str = ""
    seconds: float = 0.0


def attention_backend(family: str, device: torch.device) -> str:
    """The runtime attention backend that runs ``family`` here, or a one-line error naming what is missing."""
    if device.type == "cpu":
        return "sdpa_cpu_flash"
    if family == "fa2":
        return "flash_attn" if attention_kernel.flash_attn_available() else "sdpa_flash"
    if family == "fa3":
        if attention_kernel.fa3_available() and attention_kernel._capability(device) >= attention_kernel.FA3_MIN_CAPABILITY:
            return "fa3"
        raise CostModelError("the stack is priced with FlashAttention-3 on this GPU, but flash_attn_interface (flash-attn's "
                             "hopper build) does not import here or the GPU is not Hopper: install it, or give --stack "
                             "with a kernel that runs here (sp-plan: fa2)")
    if family == "cudnn":
        if attention_kernel.cudnn_attention_available(device):
            return "sdpa_cudnn"
        raise CostModelError("the stack is priced with cuDNN attention on this GPU, but PyTorch's cuDNN SDPA is not "
                             "available (needs cuDNN >= 9 and compute capability >= 9.0): give --stack sp-plan (fa2)")
    raise CostModelError(f"no runtime backend times the attention kernel {family!r}; give --stack sp-plan (fa2)")


def _operand_bytes(shape: GemmShape | AttentionShape, itemsize: int) -> int:
    if isinstance(shape, GemmShape):
        return itemsize * (shape.m * shape.k + shape.k * shape.n + shape.m * shape.n)
    q = shape.heads * shape.q_len * shape.head_dim
    kv = shape.kv_heads * shape.kv_len * shape.head_dim
    return itemsize * (3 if shape.backward else 2) * (q + 2 * kv)


def _gemm_call(shape: GemmShape, device: torch.device, dtype: torch.dtype):
    a = torch.randn(shape.m, shape.k, device=device, dtype=dtype)
    b = torch.randn(shape.k, shape.n, device=device, dtype=dtype)
    out = torch.empty(shape.m, shape.n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def _attention_call(shape: AttentionShape, device: torch.device, dtype: torch.dtype, backend: str):
    """One call in the runtime kernel's layout (batch, seq, heads, head_dim), K/V at their own (GQA) heads."""
    q = torch.randn(1, shape.q_len, shape.heads, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, shape.kv_len, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)  # backends without native GQA repeat K/V heads inside the call, as in training
    forward = lambda: attention_kernel.attention_forward(q, k, v, causal=shape.causal, backend=backend)
    if not shape.backward:
        return forward
    out, lse = forward()
    dout = torch.randn_like(out)
    return lambda: attention_kernel.attention_backward(dout, q, k, v, out, lse, causal=shape.causal, backend=backend)


def run_kernel_probe(kernels: list[PlannedKernel], predictor: KernelPredictor, budget_s: float,
                     device: torch.device | None = None) -> KernelProbe:
    """Time ``kernels`` within about ``budget_s`` seconds (see the module docstring)."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    if predictor.dtype not in DTYPES:
        raise CostModelError(f"--dtype {predictor.dtype}: the kernel probe times {', '.join(DTYPES)}")
    dtype = DTYPES[predictor.dtype]
    backend = attention_backend(predictor.family, device)
    kind = device.type
    itemsize = torch.empty((), dtype=dtype).element_size()
    order = sorted(kernels, key=lambda k: predictor.seconds(k.shape))
    start = time.perf_counter()
    timings: list[KernelTiming] = []
    skipped: list[PlannedKernel] = []
    ratios: dict[str, list[float]] = {}  # measured / predicted so far, per kind of kernel
    for i, planned in enumerate(order):
        predicted = predictor.seconds(planned.shape)
        seen = ratios.get(planned.shape.kind)
        expected = predicted * (statistics.median(seen) if seen else 1.0)
        left = budget_s - (time.perf_counter() - start)
        if (MIN_CALLS[kind] * expected > left
                or _operand_bytes(planned.shape, itemsize) > MAX_OPERAND_BYTES[kind]):
            skipped.append(planned)
            continue
        share = max(0.0, REPETITION_SHARE * (left - MIN_CALLS[kind] * expected) / (len(order) - i))
        try:
            if isinstance(planned.shape, GemmShape):
                call = _gemm_call(planned.shape, device, dtype)
            else:
                call = _attention_call(planned.shape, device, dtype, backend)
            seconds = measure._median_time(call, device, share, min_reps=3, max_reps=50)
        except torch.OutOfMemoryError:
            skipped.append(planned)
            continue
        finally:
            call = None  # free the operands before the next shape's
        timings.append(KernelTiming(planned, max(seconds, 1e-9)))
        ratios.setdefault(planned.shape.kind, []).append(seconds / predicted)
    return KernelProbe(timings, skipped, backend, _device_name(device), time.perf_counter() - start)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} thread(s))"


# ----- the whole kit: topology, shapes, timings, fit --------------------------------------------------------


@dataclass(frozen=True)
class KernelDefaults:
    model: str
    seq_lens: tuple[int, ...]
    layouts: tuple[dict[str, int], ...]
    budget_s: float
    dtype: str


#: What ``sp-plan probe --kernels`` times when not told. GPUs: Llama-3-8B at 4K-64K without SP, with Ulysses 8
#: (4 local heads, 1/8 of the tokens) and with ring 8 (the ring's two block shapes), in bf16. CPUs: the same
#: model at tp 8 (GEMMs of tens of milliseconds, not seconds) on 128-256 tokens, with and without a ring of 2,
#: in fp32 (the dtype CPU ranks train in).
DEFAULTS = {
    "cuda": KernelDefaults("llama3-8b", (4096, 16384, 65536), ({}, {"ulysses": 8}, {"ring": 8}), 30.0, "bf16"),
    "cpu": KernelDefaults("llama3-8b", (128, 256), ({"tp": 8}, {"tp": 8, "ring": 2}), 10.0, "fp32"),
}


def device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_topology_matches(topology, device: torch.device) -> None:
    """Refuse a topology of another kind of device: the calibration is fitted at its peak and named after its GPU."""
    gpu = topology.gpu.name
    if device.type == "cpu":
        if not gpu.startswith("cpu"):
            raise CostModelError(f"the topology describes {gpu} GPUs, but this machine has no CUDA device: give the "
                                 "topology `sp-plan probe` wrote on this machine, or leave --topology out to probe it")
        return
    from .build import match_gpu_preset

    props = torch.cuda.get_device_properties(device)
    preset = match_gpu_preset(torch.cuda.get_device_name(device), props.total_memory)
    if gpu.startswith("cpu") or (preset is not None and preset != gpu):
        raise CostModelError(f"the topology describes {gpu} devices, but this GPU is {torch.cuda.get_device_name(device)}"
                             f"{f' ({preset})' if preset else ''}: give this machine's topology, or leave --topology out "
                             "to probe it")


__all__ = ["DEFAULTS", "DTYPES", "KernelDefaults", "KernelProbe", "attention_backend", "check_topology_matches",
           "device_kind", "run_kernel_probe"]
