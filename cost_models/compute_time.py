"""GPU compute time of one transformer layer and the output layer, kernel by kernel, from shapes.

:mod:`sp_plan.cost_models.flops` counts FLOPs (for MFU); this module turns the same work into seconds with
the shape-aware kernel model (:mod:`sp_plan.cost_models.kernels`), so layouts that shrink kernels pay for it:

- **GEMMs** per layer, per GPU (T = b S / (U R) local tokens, TP-local widths), forward
  ``(m, n, k) = (tokens, out, in)``; backward the input gradient ``(m, k, n)`` and the weight gradient
  ``(k, n, m)``. Tiled MLP runs its GEMMs on ``tile`` tokens at a time; tiled loss runs the LM head on
  ``loss_chunk_tokens`` at a time. Float8 linears run the layer's GEMMs at the fp8 peak and pay memory-
  bound amax/cast passes over their operands.
- **Attention**: one causal call on the whole sequence (heads / (tp U) per GPU), unless a registered
  strategy prices the pass itself (``Strategy.attention_pass``): zigzag ring attention
  (:mod:`sp_plan.cost_models.strategies.ring`) runs R calls per pass (one causal 2c x 2c block, R-1 full
  c x 2c blocks, c = S / 2R), each followed by an LSE merge (fp32 accumulators, memory-bound: the
  stack's bytes per element) and a ring step's fixed cost. Packed
  documents (``document_length`` D) run as variable-length calls over D-token documents. Sliding-window
  layers (``ModelSpec.sliding_window`` shorter than the sequence) run the flash kernel's windowed call:
  only the pairs inside the window (:func:`sp_plan.cost_models.flops.windowed_attention_seconds`; in ring steps, only the blocks
  that reach into the window); a layer's attention time is the mean over the model's kinds of layer. A
  materialized attention runs its QK^T and PV as batched GEMMs (the softmax traffic is streaming) over
  every pair, window or not.
- **Streaming kernels** (norms, rotary, activation, residuals, softmax of a materialized attention):
  bytes from :mod:`sp_plan.cost_models.flops` at the kernel model's fraction of HBM bandwidth, reduced by the
  stack's fusion when the blocks are compiled.
- **Strategies' own kernels** (``Strategy.layer_kernels``), by compute part: Ulysses all-to-alls add the
  stack's copy passes (:mod:`sp_plan.cost_models.strategies.ulysses`).
- **Framework overhead**: the stack's host-side time per layer and pass (hooks, launch gaps).

Recompute: ``full`` re-runs the layer forward; ``selective`` re-runs it without the attention op
(``attention_outputs`` policy) or only the core attention (Megatron's ``attention_core_recompute``);
a tiled MLP re-runs its forward GEMMs once more in backward. Nothing is recomputed where a strategy keeps
the saved activations instead (``Strategy.keeps_activations``: checkpoint offload on a stack that
offloads every saved activation, :mod:`sp_plan.cost_models.strategies.offload`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .data_balance import attention_factor
from .fitted import fitted_parameters
from .flops import (
    MATERIALIZED_FORWARD_PASSES,
    mean_over_layers,
    microbatch_work,
    sparse_matmul_weights,
    windowed_attention_seconds,
)
from .gemms import (
    Gemm,
    _backward,
    _fp8_cast_elements,
    _gemm_timer,
    _grouped_gemm_timer,
    _input_grads,
    _linear_gemms,
    _moe_ffn_seconds,  # noqa: F401  (re-exported: tests price an MoE FFN through compute_time)
    _sparse_layer_gemms,
    _weight_grads,
    layer_gemm_shapes,
)
from .kernels import AttentionParams, kernel_family
from .layout import Layout
from .memo import Memo
from .model_spec import ModelSpec
from .profile import CostProfile
from .stack import StackTime, attention_kernel_for
from .strategies import implementing, on_change
from .strategies.terms import ComputeContext, ComputeTime
from .topology.topology import Topology
from .train_spec import TrainSpec


@dataclass(frozen=True, slots=True)
class Fractions:
    """Asymptotic efficiencies in effect: calibration file > topology calibration > kernel model."""

    matmul: float
    fp8_matmul: float
    attention_forward: float
    attention_backward: float
    memory: float
    attention: AttentionParams
    #: Sustained-clock factor of the GPU variant on compute-bound kernels (1.0 on the reference board).
    clock: float = 1.0


def _attention_kernel(topology: Topology, profile: CostProfile) -> tuple[str, str]:
    """(the kernel family the stack runs on this GPU, the name of the kernel-file entry that prices it:
    FlashAttention-2's where the file has none of its own).

    Gemma 2's attention-logit soft-capping (``tanh(s / cap) x cap`` on the scores) does not change the
    choice: FlashAttention-2 (``softcap``) and -3 apply it inside the kernel, one more elementwise op per
    score next to the exponential, so it is priced as the plain kernel."""
    gpu = topology.gpu.name
    family = attention_kernel_for(profile.stack.time, gpu, kernel_family(gpu))
    return family, family if family in profile.kernels.attention else "fa2"


def fractions(topology: Topology, profile: CostProfile) -> Fractions:
    c = topology.spec.calibration.compute
    k = profile.kernels
    family, name = _attention_kernel(topology, profile)
    attention = k.attention_params(family)

    def pick(raw: float | None, path: str, kernel_value: float) -> float:
        return kernel_value if raw is None or path in profile.overridden else raw

    return Fractions(
        matmul=pick(c.matmul, "gemm.peak_fraction", k.gemm.peak_fraction),
        fp8_matmul=k.gemm.fp8_peak_fraction,
        attention_forward=pick(c.attention_forward, f"attention.{name}.forward_fraction", attention.forward_fraction),
        attention_backward=pick(c.attention_backward, f"attention.{name}.backward_fraction",
                                attention.backward_fraction),
        memory=pick(c.memory, "memory_fraction", k.memory_fraction),
        attention=attention,
        clock=k.clock_factor if k.clock_factor is not None else topology.gpu.clock_factor,
    )


def efficiency_sources(topology: Topology, profile: CostProfile) -> dict[str, str]:
    """Where each value :func:`fractions` (and the stack's overhead terms) took came from, in the order
    :func:`fractions` resolves them: a calibration file, the topology's own (probed) calibration, the
    kernel-level fit (kernel benchmarks), the system-level fit (published runs), or a documented prior.
    This is what tells a user which number their own ``sp-plan calibrate`` run should move."""
    c = topology.spec.calibration.compute
    k = profile.kernels
    gpu = topology.gpu.name
    family = kernel_family(gpu)
    _, name = _attention_kernel(topology, profile)
    fitted = fitted_parameters()
    kernel_fit = {**fitted.kernels.get("all", {}), **fitted.kernels.get(family, {})}  # pinned by kernel data
    prior = f"prior (cost_models/data/kernels/{family}.yaml)"

    def kernel_source(raw: float | None, path: str) -> str:
        if path in profile.overridden:
            return "calibration file"
        if raw is not None:
            return f"topology calibration ({topology.name})"
        if path in kernel_fit:
            return "kernel data (calibration/kernels.yaml)"
        return prior

    if "clock_factor" in profile.overridden:
        clock = "calibration file"
    elif "clock_factor" in fitted.variants.get(gpu, {}):
        clock = "system-level fit (published runs on this GPU variant)"
    elif k.clock_factor is not None:
        clock = prior
    else:
        clock = f"GPU spec (cost_models/data/gpus/{gpu}.yaml)"
    stack_fit = fitted.stacks.get(profile.stack.name.removesuffix("+calibration"), {})
    calibrated_stack = profile.stack.name.endswith("+calibration")

    def stack_source(field: str) -> str:
        if calibrated_stack:
            return "calibration file or stack file"
        if field in stack_fit:
            return f"system-level fit (published {profile.stack.name} runs)"
        return f"stack file ({profile.stack.name})"

    return {
        "matmul": kernel_source(c.matmul, "gemm.peak_fraction"),
        "fp8_matmul": kernel_source(None, "gemm.fp8_peak_fraction"),
        "attention_forward": kernel_source(c.attention_forward, f"attention.{name}.forward_fraction"),
        "attention_backward": kernel_source(c.attention_backward, f"attention.{name}.backward_fraction"),
        "memory": kernel_source(c.memory, "memory_fraction"),
        "clock": clock,
        "attention_kernel": name,
        "attention_kernel_from": f"stack file ({profile.stack.name}) for {gpu}",
        "compute_overhead_fraction": stack_source("compute_overhead_fraction"),
        "layer_overhead_s": stack_source("layer_overhead_s"),
        "step_overhead_s": stack_source("step_overhead_s"),
        "kernel_data_sources": ", ".join(fitted.kernel_fit.sources),
    }


#: Components of compute time, in the order an explanation lists them.
COMPUTE_PARTS = ("gemm_forward", "gemm_backward", "attention_forward", "attention_backward", "recompute",
                 "streaming", "ulysses_copies", "fp8_casts", "stack_overhead")


#: TrainSpec fields compute time depends on (flops.WORK_FIELDS plus the ones only time reads).
COMPUTE_FIELDS = ("mode", "micro_batch", "seq_len", "dtype", "attention_kernel", "tp_sequence_parallel",
                  "checkpointing", "tiled_mlp", "tiled_loss", "document_length", "data", "fp8_linears",
                  "compiled")

_COMPUTE: Memo[ComputeTime] = Memo()


def compute_time(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
                 profile: CostProfile) -> ComputeTime:
    """Per-layer and output-layer compute seconds of one micro-batch (memoized on what they read)."""
    # Checkpoint offload changes compute only where the stack offloads instead of recomputing: keying on
    # that (not on the flag) keeps one entry for both values of the planner's offload axis elsewhere.
    # The data-parallel degrees change no kernel: the key holds the degrees that shape one.
    key = (model, *layout.model_degrees(), topology, profile, _keeps_activations(train, profile.stack.time),
           _fp8_weight_share(train, profile.stack.time), attention_factor(model, train, layout),
           *(getattr(train, f) for f in COMPUTE_FIELDS))
    return _COMPUTE.get(key, lambda: _compute(model, train, layout, topology, profile))


def _fp8_weight_share(train: TrainSpec, stack: StackTime) -> float:
    """The part of a step's FP8 weight casts one micro-batch pays: 1 / micro-batches where the stack casts
    each weight once per step (``StackTime.fp8_weight_cache``), else 1 (also without Float8 linears, so the
    memo key does not split on the micro-batch count where it changes nothing)."""
    return 1.0 / train.grad_accum if train.fp8_linears and stack.fp8_weight_cache else 1.0


def _keeps_activations(train: TrainSpec, stack: StackTime) -> bool:
    """Whether a registered strategy keeps the saved activations instead of recomputing them."""
    return any(strategy.keeps_activations(train, stack) for strategy in implementing("keeps_activations"))


class _Linears(NamedTuple):
    """One layer's linear-layer seconds (forward, backward; with FP8 the cast passes), the column-parallel
    linears' input- and weight-gradient GEMMs (what an asynchronous backward TP collective runs beside), and
    the dense GEMM shapes they came from."""

    proj_f: float
    mlp_f: float
    proj_b: float
    mlp_b: float
    col_dgrad: list[float]
    col_wgrad: list[float]
    cast_f: float
    cast_b: float


def _compute(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology,
             profile: CostProfile) -> ComputeTime:
    """One layer's and the output layer's kernels priced part by part (linears, attention, streaming
    kernels and the strategies' own, the LM head), then the stack's overhead around them.

    About 85 lines, on purpose: this is the composition of the parts, one line per term, kept in one place so
    the order of every float sum (which the golden figures pin bit for bit) is visible; the parts themselves
    are priced by the helpers below and in :mod:`sp_plan.cost_models.gemms`."""
    training = train.is_training
    b, s = train.micro_batch, train.seq_len
    tokens = b * s / layout.sp  # this rank's share of the sequence
    fr = fractions(topology, profile)
    k = profile.kernels
    stack = profile.stack.time
    a = profile.memory
    # Compute-bound kernels run at the variant's sustained clock (a 500 W H100 is slower than the 700 W
    # board the kernel data were measured on); streaming kernels are HBM-bound and keep their speed.
    peak = topology.peak_flops(train.dtype) * fr.clock
    hbm = topology.gpu.memory_bandwidth * fr.memory
    gemm_time = _gemm_timer(topology, fr, k.gemm, k.sms, peak)
    lin = _linears(model, train, layout, topology, profile, fr, peak, hbm, tokens, gemm_time)
    proj_f, mlp_f, proj_b, mlp_b, cast_f, cast_b = lin.proj_f, lin.mlp_f, lin.proj_b, lin.mlp_b, lin.cast_f, lin.cast_b

    # ----- attention -----------------------------------------------------------------------------------
    heads_local = model.num_heads / layout.head_split
    # A materialized attention runs only without ring attention (the memory model refuses the pair);
    # its score matrix is over this rank's ring chunk.
    seq_ring = s / layout.ring
    cc = ComputeContext(model=model, train=train, layout=layout, stack=stack, kernels=k, attention=fr.attention,
                        attention_fraction_forward=fr.attention_forward,
                        attention_fraction_backward=fr.attention_backward, peak=peak, hbm=hbm, tokens=tokens,
                        heads=heads_local)
    attn_f, step_f = _attention_pass(cc, gemm_time, seq_ring, False)
    attn_b, step_b = _attention_pass(cc, gemm_time, seq_ring, True) if training else (0.0, 0.0)
    # Packed rows of a long-tailed dataset (--lengths): the busiest rank's attention, not the mean's.
    imbalance = attention_factor(model, train, layout)
    if imbalance != 1.0:
        attn_f, step_f, attn_b, step_b = (t * imbalance for t in (attn_f, step_f, attn_b, step_b))

    # ----- streaming kernels, strategies' own kernels, overhead -----------------------------------------
    stream_f, stream_b, scores_s = _streaming(model, train, layout, a, stack, hbm, heads_local, seq_ring)
    extra = _strategy_kernels(cc)  # e.g. Ulysses' all-to-all copies
    overhead = stack.layer_overhead_s
    # The stack's execution overhead around the kernels (fitted per stack from end-to-end runs).
    gaps = 1.0 + stack.compute_overhead_fraction

    kernels_f = proj_f + mlp_f + cast_f + attn_f + stream_f
    for f, _ in extra.values():
        kernels_f += f
    layer_f = kernels_f * gaps + overhead
    head_g, head_chunks = _head_gemms(model, train, layout, a, tokens)
    head_gemm_f = gemm_time(head_g, count=head_chunks)
    head_f = head_gemm_f * gaps
    layers = model.num_layers
    if not training:
        parts = {"gemm_forward": layers * (proj_f + mlp_f) + head_gemm_f, "attention_forward": layers * attn_f,
                 "streaming": layers * stream_f, "fp8_casts": layers * cast_f,
                 **{part: layers * f for part, (f, _) in extra.items()},
                 "stack_overhead": (gaps - 1) * (layers * kernels_f + head_gemm_f) + layers * overhead}
        return ComputeTime(layer_f, 0.0, 0.0, attn_f, 0.0, step_f, 0.0, head_f, 0.0, _report(fr), _parts(parts),
                           layer_gemm_forward=proj_f + mlp_f, layer_ffn_forward=mlp_f)

    recompute = _recompute_seconds(train, profile, layer_f, attn_f, proj_f + mlp_f + cast_f, scores_s)
    if train.tiled_mlp:
        recompute += mlp_f  # each tile's forward again, with grad, in backward
    kernels_b = proj_b + mlp_b + cast_b + attn_b + stream_b
    for _, f in extra.values():
        kernels_b += f
    layer_b = kernels_b * gaps + overhead + recompute
    head_gemm_b = gemm_time(_backward(head_g), count=head_chunks)
    head_b = head_gemm_b * gaps
    head_recompute = head_f if train.tiled_loss else 0.0  # the chunked loss runs the LM head again
    head_b += head_recompute
    parts = {
        "gemm_forward": layers * (proj_f + mlp_f) + head_gemm_f,
        "gemm_backward": layers * (proj_b + mlp_b) + head_gemm_b,
        "attention_forward": layers * attn_f,
        "attention_backward": layers * attn_b,
        "recompute": layers * recompute + head_recompute,
        "streaming": layers * (stream_f + stream_b),
        "fp8_casts": layers * (cast_f + cast_b),
        **{part: layers * (f + fb) for part, (f, fb) in extra.items()},
        "stack_overhead": (gaps - 1) * (layers * (kernels_f + kernels_b) + head_gemm_f + head_gemm_b)
        + 2 * layers * overhead,
    }
    return ComputeTime(layer_f, layer_b, recompute, attn_f, attn_b, step_f, step_b, head_f, head_b, _report(fr),
                       _parts(parts), layer_gemm_forward=proj_f + mlp_f, layer_gemm_backward=proj_b + mlp_b,
                       layer_ffn_forward=mlp_f, layer_ffn_backward=mlp_b,
                       layer_column_dgrad=tuple(lin.col_dgrad), layer_column_wgrad=tuple(lin.col_wgrad))


def _linears(model: ModelSpec, train: TrainSpec, layout: Layout, topology: Topology, profile: CostProfile,
             fr: Fractions, peak: float, hbm: float, tokens: float,
             gemm_time: Callable[..., float]) -> _Linears:
    """The linear layers of one layer: dense GEMMs, or MLA projections, grouped expert GEMMs and the router;
    with Float8 linears, their amax + cast passes."""
    training = train.is_training
    tp = layout.tp
    k = profile.kernels
    stack = profile.stack.time
    a = profile.memory
    mlp_tile = (a.tiled_mlp_tile_tokens or model.hidden_size) if (training and train.tiled_mlp) else None
    attn_g, mlp_g, tiles = _linear_gemms(model, tokens, tp, mlp_tile)
    fp8 = train.fp8_linears
    proj_f = gemm_time(attn_g, fp8)
    mlp_f = gemm_time(mlp_g, fp8, tiles)
    proj_b = gemm_time(_backward(attn_g), fp8)
    mlp_b = gemm_time(_backward(mlp_g), fp8, tiles)
    # The column-parallel linears (Q/K/V; up/gate or fc1): their input- and weight-gradient GEMMs are what
    # an asynchronous backward TP collective runs beside (StackTime.tp_async_dgrad).
    col_dgrad, col_wgrad = [0.0, 0.0], [0.0, 0.0]
    if training and tp > 1:
        col_attn, col_mlp = attn_g[:3], mlp_g[:-1]
        col_dgrad = [gemm_time(_input_grads(col_attn), fp8), gemm_time(_input_grads(col_mlp), fp8, tiles)]
        col_wgrad = [gemm_time(_weight_grads(col_attn), fp8), gemm_time(_weight_grads(col_mlp), fp8, tiles)]
    if model.moe is not None or model.mla is not None:  # MLA projections, grouped expert GEMMs, router
        grouped_time = _grouped_gemm_timer(topology, fr, k.gemm, k.sms, peak)
        dense_b = (proj_b, mlp_b)
        proj_f, proj_b, mlp_f, mlp_b = _sparse_layer_gemms(model, tokens, tp, mlp_tile, gemm_time, grouped_time,
                                                           fp8, (mlp_f, mlp_b), layout.ep)
        # The same share of each side's backward GEMMs as in the dense layer of these widths.
        scale = [new / old if old > 0 else 0.0 for new, old in zip((proj_b, mlp_b), dense_b, strict=True)]
        col_dgrad = [t * f for t, f in zip(col_dgrad, scale, strict=True)]
        col_wgrad = [t * f for t, f in zip(col_wgrad, scale, strict=True)]
    cast_f = cast_b = 0.0
    if fp8:  # amax + cast passes over each GEMM's activation and weight (forward), and the output grad
        d = train.dtype_bytes
        elems_f, elems_b = _fp8_cast_elements(model, tokens, tp, layout.ep, attn_g, mlp_g, tiles, mlp_tile,
                                              _fp8_weight_share(train, stack))
        cast_f = stack.fp8_cast_passes * elems_f * (d + 1) / hbm
        cast_b = stack.fp8_cast_passes * elems_b * (d + 1) / hbm
    return _Linears(proj_f, mlp_f, proj_b, mlp_b, col_dgrad, col_wgrad, cast_f, cast_b)


def _streaming(model: ModelSpec, train: TrainSpec, layout: Layout, a, stack: StackTime,
               hbm: float, heads_local: float, seq_ring: float) -> tuple[float, float, float]:
    """Seconds of one layer's HBM-bound streaming kernels (forward, backward; norms, activations, residuals,
    a materialized attention's softmax passes, unfused eager modules' extra passes) and of the materialized
    score passes alone (what recomputing them costs; 0 with flash attention)."""
    b, s, d = train.micro_batch, train.seq_len, train.dtype_bytes
    flash = train.attention_kernel == "flash"
    w = microbatch_work(model, train, layout)
    stream = 1.0 if not train.compiled else stack.compiled_stream_fraction
    scores_f = 0.0
    if not flash:  # the softmax passes of a materialized attention are not fused by compile
        scores_f = MATERIALIZED_FORWARD_PASSES * b * heads_local * seq_ring * s * d
    eager = _eager_extra_bytes(model, train, layout, a)  # unfused eager modules' extra passes
    stream_f = ((w.layer_stream_fwd_bytes - scores_f + eager) * stream + scores_f) / hbm
    stream_b = ((w.layer_stream_bwd_bytes - 2 * scores_f + 2 * eager) * stream + 2 * scores_f) / hbm
    scores_s = 0.0 if flash else MATERIALIZED_FORWARD_PASSES * b * heads_local * seq_ring * s * d / hbm
    return stream_f, stream_b, scores_s


def _head_gemms(model: ModelSpec, train: TrainSpec, layout: Layout, a,
                tokens: float) -> tuple[list[Gemm], int]:
    """The LM head's GEMM shape and how many chunks of it run (a tiled loss runs it chunk by chunk)."""
    training = train.is_training
    head_tokens = tokens if training else train.micro_batch / layout.sp
    head_rows = min(a.loss_chunk_tokens, head_tokens) if (training and train.tiled_loss) else head_tokens
    head_chunks = math.ceil(head_tokens / head_rows)
    return [(head_rows, model.vocab_size / layout.tp, model.hidden_size)], head_chunks


def _attention_pass(cc: ComputeContext, gemm_time: Callable[..., float], seq_ring: float,
                    backward: bool) -> tuple[float, float]:
    """(kernel seconds of one attention pass, seconds of the share a transfer can hide behind)."""
    train, hd = cc.train, cc.model.head_dim
    s, doc = train.seq_len, train.attention_document_length
    bh = train.micro_batch * cc.heads
    if train.attention_kernel != "flash":
        big = [(seq_ring * bh, seq_ring, hd), (seq_ring * bh, hd, seq_ring)]  # QK^T, PV (batched)
        t = gemm_time(_backward(big) if backward else big)
        return t, t
    for strategy in implementing("attention_pass"):  # one that splits the keys (ring) prices its calls
        priced = strategy.attention_pass(cc, backward)
        if priced is not None:
            return priced

    def one_call(window: int | None) -> tuple[float, float]:
        if doc is not None and doc < s:
            t = windowed_attention_seconds(cc.attention_seconds, cc.attention.launch_s, bh * s / doc, doc, window, backward)
        else:
            t = windowed_attention_seconds(cc.attention_seconds, cc.attention.launch_s, bh, s, window, backward)
        return t, t

    return mean_over_layers(cc.model, s, one_call)  # sliding-window layers run shorter calls


def _recompute_seconds(train: TrainSpec, profile: CostProfile, layer_f: float, attn_f: float, gemms_f: float,
                       scores_s: float) -> float:
    """Seconds backward spends re-running one layer's forward for the checkpointing mode (``gemms_f``:
    its projection, MLP and fp8-cast kernels; ``scores_s``: a materialized attention's softmax passes)."""
    ckpt = train.checkpointing
    if _keeps_activations(train, profile.stack.time):
        return 0.0  # every saved activation goes to the host and comes back: nothing is recomputed
    if ckpt == "full":
        return layer_f
    if ckpt != "selective":
        return 0.0
    policy = profile.memory.selective_policy
    if policy == "attention_core_recompute":
        return attn_f + scores_s
    if policy == "op_sac":
        # torchtitan's per-op policy keeps the attention outputs and every other matmul's output: half the
        # GEMMs and all elementwise kernels run again.
        return layer_f - attn_f - gemms_f / 2
    return layer_f - attn_f


def _strategy_kernels(cc: ComputeContext) -> dict[str, tuple[float, float]]:
    """The registered strategies' extra kernels per layer, by compute part (summed where two name one)."""
    out: dict[str, tuple[float, float]] = {}
    for strategy in implementing("layer_kernels"):
        for part, (f, b) in strategy.layer_kernels(cc).items():
            f0, b0 = out.get(part, (0.0, 0.0))
            out[part] = (f0 + f, b0 + b)
    return out


def _parts(values: dict[str, float]) -> dict[str, float]:
    """The parts in :data:`COMPUTE_PARTS` order (absent ones 0), then any part only a strategy names."""
    return {**{name: values.get(name, 0.0) for name in COMPUTE_PARTS},
            **{name: v for name, v in values.items() if name not in COMPUTE_PARTS}}


#: HBM bytes per element of an eager RMSNorm forward in bf16 (HF's LlamaRMSNorm, torchtitan's default
#: torch.nn.RMSNorm outside compile): cast to fp32 (2 + 4), square (4 + 4), mean (4), rsqrt x (4 + 4 + 4),
#: cast back (4 + 2), weight multiply (2 + 2 + 2) = 42 B, against a fused kernel's read and write (4 B).
EAGER_RMSNORM_BYTES_PER_ELEMENT = 42.0


def _eager_extra_bytes(model: ModelSpec, train: TrainSpec, layout: Layout, a) -> float:
    """Forward HBM bytes per layer that unfused (eager) norm and SwiGLU kernels move beyond the fused ones
    :mod:`sp_plan.cost_models.flops` counts (backward moves about twice as much)."""
    d = train.dtype_bytes
    tokens = train.micro_batch * train.seq_len / layout.sp
    tp = layout.tp
    norm_tokens = tokens / tp if (tp > 1 and train.tp_sequence_parallel) else tokens
    extra = 0.0
    if a.norm_implementation == "eager" and model.norm == "rmsnorm":
        extra += 2 * norm_tokens * model.hidden_size * max(0.0, EAGER_RMSNORM_BYTES_PER_ELEMENT * d / 2 - 2 * d)
    if a.mlp_implementation == "eager" and model.activation == "swiglu":
        width = model.ffn_hidden_size / tp
        if model.moe is not None:  # the mean layer's SwiGLU rows: routed rows x expert width + shared experts
            width = sparse_matmul_weights(model, tp, tokens).activation_width / 3
        extra += 2 * tokens * width * d  # silu writes its output, the multiply reads it
    return extra


def _report(fr: Fractions) -> dict[str, float]:
    return {"matmul": fr.matmul, "fp8_matmul": fr.fp8_matmul, "attention_forward": fr.attention_forward,
            "attention_backward": fr.attention_backward, "memory": fr.memory, "clock": fr.clock}


on_change(_COMPUTE.clear)

__all__ = ["COMPUTE_FIELDS", "COMPUTE_PARTS", "ComputeTime", "Fractions", "compute_time", "efficiency_sources",
           "fractions", "layer_gemm_shapes"]
