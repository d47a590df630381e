"""What a strategy hands the summing models, and what they hand it back: the shared vocabulary.

A strategy (:mod:`sp_plan.cost_models.strategies.base`) contributes three kinds of things:

- :class:`CommOp`: the collectives it issues (``comm_volume`` sums their bytes; ``time_model`` prices
  them on the topology as :class:`PricedOp` and applies the overlap rules);
- per-layer compute adjustments, read from a :class:`ComputeContext` (``compute_time`` adds them);
- :class:`Term`: step-time terms that no generic overlap rule covers, read from a :class:`TimeContext`
  (``time_model`` adds them up with everything else).

This module imports nothing above the specs and the kernel model, so the strategies and the three
models that sum them can all import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from ..flops import FLASH_BACKWARD_RATIO
from ..kernels import AttentionParams, KernelModel, attention_seconds
from ..layout import Layout
from ..model_spec import ModelSpec
from ..stack import StackTime
from ..topology.topology import Topology
from ..train_spec import TrainSpec


class CommOp(NamedTuple):
    """One collective issued per layer (``scope="layer"``) or per model pass (``scope="model"``).

    ``strategy``: the report bucket it counts under (``comm.per_step_by_strategy`` and the time
    estimate's ``*_by_strategy`` keys). ``per``: "microbatch" (every micro-batch) or "step" (once per
    optimizer step). ``overlap``: how the time model may hide it: ``exposed`` (on the critical path),
    ``prefetch`` (FSDP gathers/scatters, hidden behind layer compute), ``grad`` (gradient reductions,
    hidden behind backward compute), or a class a strategy prices itself (``ring``: a ring-attention hop,
    hidden behind the next block's compute; see :attr:`Strategy.overlap_classes`).
    """

    strategy: str
    collective: str
    group: str
    nbytes: float
    phase: str  # forward | backward | step
    scope: str = "layer"
    per: str = "microbatch"
    count: int = 1
    recompute: bool = False
    overlap: str = "exposed"
    label: str = ""
    #: (top_k, experts) for a MoE dispatch whose dispatcher sends each token once per remote node
    #: (:func:`~sp_plan.cost_models.collectives.node_dedup_fabric_fraction`); (0, 0): a plain collective.
    node_dedup: tuple[int, int] = (0, 0)
    #: Traffic only some stacks issue: the stack fact it needs (e.g. :data:`TP_INPUT_REGATHER`), or "" for every
    #: stack.
    #: Consumers that know the stack keep the op when :func:`issued` says so.
    only_if: str = ""


#: Stack-dependent traffic an op may be conditioned on (``CommOp.only_if``), and what decides it:
#: ``tp_input_regather``: the column-parallel linears save only their input's sequence shard and all-gather
#: it again in backward for the weight gradient (``memory.tp_saves_gathered_input`` false: Megatron,
#: Transformer Engine).
TP_INPUT_REGATHER = "tp_input_regather"


def issued(op: CommOp, traffic: frozenset[str]) -> bool:
    """Whether a stack whose traffic facts are ``traffic`` issues ``op``."""
    return not op.only_if or op.only_if in traffic


class PricedOp(NamedTuple):
    """A :class:`CommOp` priced on a topology: seconds of one occurrence, and the bytes of one occurrence
    that cross nodes."""

    op: CommOp
    seconds: float
    fabric_bytes: float


@dataclass(frozen=True, slots=True)
class ComputeTime:
    """Seconds per micro-batch on one GPU. ``layer_*`` for one transformer layer; ``*_recompute`` is
    the backward's recomputation (included in ``layer_backward``); ``attention_*`` are the attention
    kernels alone (with ring steps' merges and fixed costs), included in the layer figures, and
    ``ring_step_*`` one ring step's share of them (what a K/V hop can hide behind)."""

    layer_forward: float
    layer_backward: float
    layer_recompute: float
    attention_forward: float
    attention_backward: float
    ring_step_forward: float
    ring_step_backward: float
    head_forward: float
    head_backward: float
    fractions: dict[str, float]
    #: One micro-batch's compute by component (every layer and the output layer; forward and backward):
    #: the same seconds as ``num_layers * (layer_forward + layer_backward) + head_forward + head_backward``,
    #: split into what ``sp-plan estimate --explain-time`` shows (``compute_time.COMPUTE_PARTS``, then
    #: any part a registered strategy adds).
    parts: dict[str, float]
    #: One layer's linear-layer GEMM kernels (projections and MLP or experts), forward and backward (input
    #: and weight gradients, recompute excluded): what overlapped TP collectives hide behind.
    layer_gemm_forward: float = 0.0
    layer_gemm_backward: float = 0.0
    #: Of those, the MLP's (a MoE layer's router, experts and shared experts; the mean layer): what the
    #: MoE dispatch/combine all-to-alls of another micro-batch hide behind (the rest of the layer is the
    #: attention side).
    layer_ffn_forward: float = 0.0
    layer_ffn_backward: float = 0.0
    #: The column-parallel linears' GEMMs of one layer (attention side: Q/K/V; MLP side: up/gate or fc1),
    #: input gradient and weight gradient: what an asynchronous backward TP collective hides behind
    #: (``StackTime.tp_async_dgrad``).
    layer_column_dgrad: tuple[float, float] = (0.0, 0.0)
    layer_column_wgrad: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True, slots=True)
class ComputeContext:
    """One layer's shapes and the kernel model in effect, for a strategy's compute adjustments.

    ``tokens``: this rank's tokens (after the sequence split); ``heads``: its query heads (after the
    head split). ``peak`` is the clocked peak FLOP/s of the training dtype, ``hbm`` the effective HBM bandwidth.
    """

    model: ModelSpec
    train: TrainSpec
    layout: Layout
    stack: StackTime
    kernels: KernelModel
    attention: AttentionParams
    attention_fraction_forward: float
    attention_fraction_backward: float
    peak: float
    hbm: float
    tokens: float
    heads: float

    def attention_seconds(self, batch_heads: float, q_len: float, kv_len: float, causal: bool, backward: bool,
                          calls: float = 1.0) -> float:
        """Seconds of ``calls`` flash-attention calls of this layer's head_dim, forward or backward."""
        fraction = self.attention_fraction_backward if backward else self.attention_fraction_forward
        ratio = FLASH_BACKWARD_RATIO if backward else 1.0
        return attention_seconds(batch_heads, q_len, kv_len, self.model.head_dim, causal, self.peak, fraction,
                                 self.attention, self.kernels.sms, ratio, calls=calls)


class HostBytes(Protocol):
    """What lives in host memory per GPU, in bytes (``time_model.OffloadTraffic`` is one)."""

    @property
    def optimizer_bytes(self) -> float: ...

    @property
    def param_bytes(self) -> float: ...

    @property
    def checkpoint_bytes(self) -> float: ...


class TimeContext(NamedTuple):
    """Everything a strategy's step-time terms may read: the specs, the topology and profile, this
    micro-batch's compute (``compute``), the host-resident bytes (``offload``), and the ops of the overlap
    classes strategies price themselves, priced on the topology (``priced``: class -> what the claiming
    strategy's ``condense`` made of its ops, by default the priced ops in the order they were issued).
    (A tuple: the planner builds one per evaluation.)"""

    model: ModelSpec
    train: TrainSpec
    layout: Layout
    topology: Topology
    stack: StackTime
    kernels: KernelModel
    compute: ComputeTime
    offload: HostBytes
    priced: Mapping[str, object]

    @property
    def layers(self) -> int:
        return self.model.num_layers

    @property
    def accum(self) -> int:
        return self.train.grad_accum

    @property
    def training(self) -> bool:
        return self.train.is_training

    @property
    def slowdown(self) -> float:
        """Compute slowed per second of overlapped collective (NCCL kernels take SMs and HBM bandwidth)."""
        return self.kernels.nccl_compute_slowdown


#: Which step-time figure a :class:`Term` adds to.
TermKind = Literal["exposed_comm", "hidden_comm", "interference", "offload", "optimizer", "host_sync"]
#: How often a :class:`Term`'s seconds occur: per layer and micro-batch in the forward or backward pass,
#: per micro-batch, or once per step.
TermAt = Literal["layer_forward", "layer_backward", "microbatch", "step"]


class Term(NamedTuple):
    """Seconds a strategy adds to the step, beyond its ops that the generic overlap rules price.

    ``kind="exposed_comm"`` needs ``bucket`` (the report bucket the time counts under); ``hidden_comm``
    (with its bucket) is communication a strategy hid behind compute: reported, not added to the step;
    ``interference`` is compute slowed by overlapped collectives; ``host_sync`` is GPU idle while the host
    waits on a device-to-host synchronisation (per layer: :mod:`.moe_host`). Layer and micro-batch terms are part of a
    micro-batch's time (``breakdown.microbatch_s``); ``offload`` and ``optimizer`` terms are counted once per step
    (``at="step"``), so a per-micro-batch transfer is passed already multiplied by the accumulation.
    (A tuple: the planner builds a few per evaluation.)
    """

    kind: TermKind
    seconds: float
    at: TermAt = "step"
    bucket: str = ""


__all__ = ["TP_INPUT_REGATHER", "CommOp", "ComputeContext", "ComputeTime", "HostBytes", "PricedOp",
           "Term", "TermAt", "TermKind", "TimeContext", "issued"]
