"""Communication a stack hides behind compute: TP collectives inside their GEMMs, MoE all-to-alls behind
another micro-batch. The mechanisms, their conditions and their bounds, shared by :mod:`.tp` and :mod:`.expert`.

**Chunked TP overlap** (stack ``tp_comm_overlap``). Transformer Engine's userbuffers (Megatron-Core
``--tp-comm-overlap``) and torch's AsyncTP (torchtitan ``compile.enable_async_tensor_parallel``) split a
sequence-parallel all-gather or reduce-scatter into ``n`` chunks and run chunk i's transfer while the GEMM
of chunk i-1 computes: a two-stage pipeline. With T seconds of transfer and G of GEMM, its time is
``(n-1) max(T/n, G/n) + T/n + G/n``, so the transfer adds ``T/n + (n-1)/n max(0, T - G)`` to the GEMM:
one chunk is always exposed (the first all-gather chunk before the GEMM can start, the last reduce-scatter
chunk after it ends) and the rest hides as far as the GEMM's other chunks last (:func:`pipelined_exposure`).
Chunks: an all-gather runs a ring exchange in tp chunks (TE ``ring_exchange``: ``num_splits = tp_size``;
AsyncTP: one chunk per rank); TE's forward reduce-scatters (proj_fprop, fc2_fprop) use its ``pipeline``
method with ``num_splits`` 4 and ``num_sm`` 16 SMs taken from the GEMM (``set_sm_margin``)
(``transformer_engine/pytorch/module/base.py`` ``get_default_config``). Backward collectives (TE: bulk
overlaps of the input all-gather with the dgrad GEMM and of the dgrad reduce-scatter with the wgrad GEMM,
ring exchange for proj/fc2 dgrad) are priced the same way against the backward GEMMs with tp chunks.
Conditions: sequence parallelism (Megatron's ``validate_args``: "Tensor parallel communication/GEMM overlap
can happen only when sequence parallelism is enabled"; AsyncTP fuses all-gather+matmul and
matmul+reduce-scatter, which exist only then) and, for AsyncTP, torch.compile (torchtitan's CompileConfig
raises "Async TP requires 'model' in --compile.components and --compile.enable").

**MoE all-to-all overlap** (stack ``moe_a2a_overlap``; Megatron-Core
``--overlap-moe-expert-parallel-comm``). The combined 1F1B schedule runs the forward of one micro-batch
with the backward of another, layer by layer on two streams
(``megatron/core/models/common/model_chunk_schedule_plan.py`` ``TransformerLayerSchedulePlan.run``)::

    comm stream: combine_bwd      | dispatch_fwd -> dispatch_bwd   | combine_fwd
    comp stream: attention fwd    | mlp bwd -> mlp wgrad -> mlp fwd | attention bwd

so each of the three all-to-all slots hides behind its compute slot and exposes what exceeds it
(:func:`a2a_pair_exposure`). The first micro-batch's forward and the last one's backward run alone
(``combined_1f1b.py``: "The forward step for the first microbatch is executed alone"); under pipeline
parallelism the warm-up forwards and cool-down backwards are not paired either: at the first stage
``2(p-1)`` plus the extra forward the schedule adds (``schedules.py``: "we schedule one extra micro-batch
forward step before the 1f1b stages"), so ``min(1, (2p-1)/m)`` of the m micro-batches' passes run
unpaired (:func:`unpaired_fraction`). Interleaved stages warm up ``p(v+1)-1`` of ``m v`` chunk passes,
never a larger share, so the ``v = 1`` count is used for every schedule (a bound, which keeps the
planner's lower bounds valid: more chunks never price more exposure). Conditions (``transformer_config.py``
asserts): ep > 1, no full recompute, two micro-batches per step (one is nothing to pair with), and with
pp > 1 virtual pipeline stages ("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be
specified when pipeline_model_parallel_size > 1"): a one-chunk pipelined plan runs its all-to-alls exposed
(the planner's pipelined bound therefore takes the faster of one and two chunks). Its memory cost, one more micro-batch's activations in flight, is the memory
model's to price.

Overlapped transfers slow the compute they run beside: the kernel model's ``nccl_compute_slowdown`` per
hidden second, or, where the stack takes SMs from the GEMM (``tp_overlap_sm_margin``), the GEMM's time on
the remaining SMs.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..layout import Layout
from ..model_spec import ModelSpec
from ..stack import StackProfile, StackTime
from ..train_spec import TrainSpec

#: Human names of the TP overlap mechanisms (for reports).
TP_OVERLAP_NAMES = {"userbuffers": "Transformer Engine userbuffers (--tp-comm-overlap)",
                    "async_tp": "AsyncTP (symmetric-memory micro-pipelining)"}


def pipelined_exposure(transfers: Iterable[tuple[float, int]], compute: float) -> float:
    """Seconds of transfer left on the critical path when each (seconds, chunks) transfer is pipelined with
    ``compute`` seconds of GEMM in as many chunks: every transfer's first chunk, plus what the other chunks
    carry beyond the GEMM's chunks they run beside (a two-stage pipeline; see the module doc). Between the
    first chunks' sum and the transfers' whole time; never hides more than ``compute``."""
    items = [(t, max(1, n)) for t, n in transfers if t > 0]
    if not items:
        return 0.0
    first = sum(t / n for t, n in items)
    rest = sum(t for t, _ in items) - first
    chunks = min(n for _, n in items)
    return first + max(0.0, rest - max(0.0, compute) * (chunks - 1) / chunks)


def tp_overlap_blocker(stack: StackTime, train: TrainSpec, layout: Layout) -> str | None:
    """Why the stack's TP overlap does not run for this plan, or None when it does."""
    if stack.tp_comm_overlap == "none":
        return "the stack file sets tp_comm_overlap: none"
    if layout.tp == 1:
        return "tp = 1"
    if not train.tp_sequence_parallel:
        return "needs TP sequence parallelism (all-reduces are not split)"
    if stack.tp_comm_overlap == "async_tp" and not train.compiled:
        return "AsyncTP needs torch.compile (--compiled)"
    return None


def a2a_overlap_blocker(stack: StackTime, model: ModelSpec, train: TrainSpec, layout: Layout) -> str | None:
    """Why the stack's MoE all-to-all overlap does not run for this plan, or None when it does."""
    if not stack.moe_a2a_overlap:
        return "the stack file sets moe_a2a_overlap: false"
    if model.moe is None or layout.ep == 1:
        return "ep = 1"
    if not train.is_training:
        return "forward only: no backward to pair with"
    if train.checkpointing == "full":
        return "full recompute (Megatron-Core refuses it with the overlap)"
    if train.grad_accum < 2:
        return "one micro-batch per step: nothing to pair with"
    if layout.pp > 1 and train.virtual_stages == 1:
        return "pp > 1 without virtual stages (Megatron-Core asserts them for the overlap)"
    return None


def unpaired_fraction(pp: int, microbatches: int) -> float:
    """Share of a step's forward and backward passes that run unpaired under the combined 1F1B schedule."""
    return min(1.0, (2 * pp - 1) / microbatches)


def a2a_pair_exposure(a2a: float, attention_f: float, ffn_f: float, attention_b: float, ffn_b: float) -> float:
    """Exposed seconds of one layer's four all-to-alls (each ``a2a`` seconds) when one micro-batch's
    forward runs with another's backward: each slot of the combined schedule hides behind its compute."""
    return (max(0.0, a2a - attention_f) + max(0.0, 2 * a2a - ffn_f - ffn_b) + max(0.0, a2a - attention_b))


def tp_overlap_note(stack: StackTime, stack_name: str, train: TrainSpec, layout: Layout) -> str:
    """Where the TP overlap comes from, for ``--explain-time``."""
    blocker = tp_overlap_blocker(stack, train, layout)
    if blocker is not None:
        if stack.tp_async_dgrad and layout.tp > 1 and train.is_training:
            return (f"not chunked: {blocker} (stack file {stack_name}); backward: each column-parallel "
                    "linear's input-gradient reduction runs beside its weight-gradient GEMM (tp_async_dgrad), "
                    "the rest exposed")
        return f"exposed: {blocker} (stack file {stack_name})"
    rs = stack.tp_overlap_reduce_scatter_chunks or layout.tp
    margin = f", {stack.tp_overlap_sm_margin} SMs taken from the GEMM" if stack.tp_overlap_sm_margin else ""
    bulk = ("; backward: the column-parallel linears' input re-gather and input-gradient reduce-scatter run "
            "beside their own GEMMs (TE bulk overlaps)" if stack.tp_comm_overlap == "userbuffers" else "")
    return (f"{TP_OVERLAP_NAMES[stack.tp_comm_overlap]} (stack file {stack_name}): all-gathers in {layout.tp} "
            f"chunks, reduce-scatters in {rs}{margin}; the first chunk of each is exposed{bulk}")


#: How each ``StackTime.moe_dispatcher`` moves tokens across nodes (for reports).
DISPATCHER_NAMES = {"alltoall": "NCCL all-to-all of the permuted rows (a copy per remote expert)",
                    "deepep": "DeepEP (a token crosses to each remote node once, NVLink fan-out there)",
                    "hybridep": "Hybrid-EP (a token crosses to each remote node once, NVLink fan-out there)"}


def a2a_overlap_note(stack: StackTime, stack_name: str, model: ModelSpec, train: TrainSpec, layout: Layout) -> str:
    """Where the MoE all-to-all overlap comes from, and which dispatcher moves the tokens, for ``--explain-time``."""
    dispatcher = f"; dispatcher: {DISPATCHER_NAMES[stack.moe_dispatcher]}"
    blocker = a2a_overlap_blocker(stack, model, train, layout)
    if blocker is not None:
        return f"exposed: {blocker} (stack file {stack_name}){dispatcher}"
    share = unpaired_fraction(layout.pp, train.grad_accum)
    return (f"combined 1F1B EP overlap (stack file {stack_name}: moe_a2a_overlap): behind another micro-batch's "
            f"attention and expert MLPs; {share:.0%} of passes unpaired (first forward, last backward"
            f"{', pipeline warm-up/cool-down' if layout.pp > 1 else ''}){dispatcher}")


def overlap_sources(stack: StackProfile, model: ModelSpec, train: TrainSpec, layout: Layout) -> dict[str, str]:
    """Where each overlap of this plan comes from (``TimeEstimate.efficiency_sources`` entries), for the
    strategies it concerns: ``tp_overlap`` when tp > 1, ``ep_overlap`` when ep > 1 with experts."""
    out: dict[str, str] = {}
    if layout.tp > 1:
        out["tp_overlap"] = tp_overlap_note(stack.time, stack.name, train, layout)
    if layout.ep > 1 and model.moe is not None:
        out["ep_overlap"] = a2a_overlap_note(stack.time, stack.name, model, train, layout)
    return out


__all__ = ["DISPATCHER_NAMES", "TP_OVERLAP_NAMES", "a2a_overlap_blocker", "a2a_overlap_note", "a2a_pair_exposure", "overlap_sources",
           "pipelined_exposure",
           "tp_overlap_blocker", "tp_overlap_note", "unpaired_fraction"]
