"""``auto_configure``: from "this model, this sequence length, these GPUs" to a sequence-parallel run.

Inside a torchrun launch (or a single process), one call::

    setup = auto_configure(model, seq_len=131072)
    for batch in loader:                                   # full-sequence batches (see sp_plan.runtime.data)
        shard = setup.shard(batch)                         # pre-shifted, padded, this rank's shard
        out = setup.loss(setup.forward(shard), shard["labels"])
        out.loss.backward()

does, in order (each step a function below, so later techniques slot in locally):

1. **plan**: a :class:`sp_plan.planner.plan.Plan`, a plan file, or None: rank 0 asks the planner, for the
   topology given (a Topology, a preset/file name) or probed on the spot, restricted to what this
   runtime can execute (:mod:`sp_plan.runtime.capabilities`); the plan is broadcast and every rank checks
   that it holds the same plan (a hash of its JSON);
2. **refuse** options the runtime cannot execute (:func:`sp_plan.runtime.capabilities.unsupported_reasons`),
   and a plan made for another model or sequence length;
3. **mesh**: :func:`sp_plan.runtime.mesh.build_mesh` (5-D DeviceMesh + ``sp``/``fsdp`` dims) and a ``data``
   group (every rank but TP) for the loss;
4. **attention**: the model's attention becomes the planned SP attention
   (:class:`sp_plan.runtime.context.SequenceParallel`): our :class:`~sp_plan.runtime.models.LlamaModel` through its
   ``attention_fn``, HF models through transformers' attention registry (:mod:`sp_plan.runtime.hf`);
5. **tensor parallelism** (:mod:`sp_plan.runtime.tp`, Megatron column/row split with sequence parallelism
   per the plan's ``tp_sequence_parallel``) on the full, rank-0-synchronised weights, before anything
   shards them further;
6. **activation checkpointing** per plan (none / selective / full, per block), with the checkpointed
   block inputs offloaded to host memory when the plan says ``offload_checkpoints``
   (:mod:`sp_plan.runtime.offload`), and the **tiled MLP** (:mod:`sp_plan.runtime.tiled_mlp`);
7. **FSDP2** ``fully_shard`` per block, the untied embedding, and the root, over the ``fsdp`` dim
   (HSDP over ``dp_replicate x fsdp`` when dp_replicate > 1), with the plan's mixed precision and
   ``offload_params`` (CPUOffloadPolicy) from :func:`sp_plan.runtime.fsdp.fully_shard_kwargs`; gradients are
   summed (divide factor 1) because the loss is normalised by the global token count
   (:mod:`sp_plan.runtime.loss`);
8. the **loss** the plan asks for (:meth:`AutoConfigured.compute_loss`: tiled cross-entropy from the
   final hidden states, vocab-parallel under TP) and the **optimizer** (:meth:`AutoConfigured.make_optimizer`:
   AdamW, or :class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer` for ``offload_optimizer``; TP's
   replicated-gradient all-reduce runs before every step).

ZeRO stages with FSDP2 (what :func:`sp_plan.runtime.step.train_step` toggles per micro-batch):

- 3: ``reshard_after_forward=True``: parameters gathered for forward and again for backward,
  gradients reduce-scattered every micro-batch;
- 2: ``reshard_after_forward=False`` and no resharding between micro-batches of a step: parameters
  gathered once per step, gradients reduce-scattered every micro-batch;
- 1: as 2, but gradients accumulate unsharded and are reduce-scattered once per step.

Between steps parameters stay sharded (FSDP2 always reshards after the last backward), so ZeRO-1/2
hold less than the memory model's full replica of the weights; communication follows the model.

A training loop written by hand (rather than :func:`sp_plan.runtime.step.train_step`)::

    optimizer = setup.make_optimizer(lr=3e-4)
    for batch in loader:
        out = setup.compute_loss(setup.shard(batch))
        out.loss.backward()
        setup.clip_grad_norm_(1.0)          # optional; syncs TP-replicated gradients first
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.runtime.capabilities import MEMORY_ASSUMPTIONS, merge_constraints, unsupported_reasons
from sp_plan.runtime.fsdp import DTYPES, fully_shard_kwargs, fully_shard_units, needs_compute_dtype_params
from sp_plan.runtime.context import SequenceParallel
from sp_plan.runtime.data import BatchSharder, data_parallel_coordinates, data_parallel_sampler
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.loss import LossOutput, TokenLoss
from sp_plan.runtime.mesh import RuntimeMesh, build_mesh, init_default_group

#: Probe budgets (seconds per compute measurement, seconds for all link timings) when auto_configure has
#: to measure the machine itself: enough for a usable topology, short enough to run before every job.
AUTO_PROBE_BUDGETS = {"cpu": (0.05, 0.5), "cuda": (0.2, 5.0)}
#: Architecture fields a plan's model must share with the model being trained (names and published
#: totals may differ).
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
    "tied_embeddings", "activation", "norm", "position_embedding", "qkv_bias", "attn_out_bias", "mlp_bias",
    "qk_norm",
)
COMPUTE_DTYPES = DTYPES
#: Memory techniques a plan may switch on (shown when on).
TECHNIQUES = ("tiled_mlp", "tiled_loss", "offload_checkpoints", "offload_optimizer", "offload_params")


# ----- the result ------------------------------------------------------------------------------------------


class SequenceParallelAttention(nn.Module):
    """``attention_fn`` for :class:`sp_plan.runtime.models.LlamaModel`: the planned SP attention on local shards."""

    def __init__(self, sp: SequenceParallel) -> None:
        super().__init__()
        self.sp = sp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        return self.sp.attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)

    def extra_repr(self) -> str:
        return repr(self.sp)


@dataclass
class AutoConfigured:
    """What :func:`auto_configure` built. ``model`` is the wrapped (FSDP2) model."""

    model: nn.Module
    plan: Any  # sp_plan.planner.plan.Plan
    mesh: RuntimeMesh
    sp: SequenceParallel
    sharder: BatchSharder
    loss_fn: TokenLoss
    data_group: dist.ProcessGroup | None
    kind: str  # "llama" | "hf"
    compute_dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    #: The TP state (sp_plan.runtime.tp.TensorParallel) when the plan has tp > 1, else None.
    tensor_parallel: Any = None
    #: The checkpoint offload (sp_plan.runtime.offload.CheckpointOffload) when the plan offloads checkpoints.
    checkpoint_offload: Any = None
    #: Set when TP-replicated gradients were all-reduced; cleared by every forward (new gradients).
    _grads_synced: bool = field(default=False, repr=False)

    # -- convenience -----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def train(self) -> TrainSpec:
        return self.plan.train

    @property
    def dp_rank(self) -> int:
        return data_parallel_coordinates(self.mesh)[0]

    @property
    def dp_size(self) -> int:
        return data_parallel_coordinates(self.mesh)[1]

    def shard(self, batch: Any) -> dict[str, torch.Tensor]:
        """This rank's shard of a full-sequence batch (see :class:`sp_plan.runtime.data.BatchSharder`)."""
        return self.sharder(batch)

    def forward(self, shard: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits of this rank's tokens for a sharded batch (global position ids, no mask); under tensor
        parallelism this rank's vocabulary slice (:meth:`loss` knows). Materialises the logits even when
        the plan has ``tiled_loss``: train with :meth:`compute_loss`."""
        self._grads_synced = False
        if self.kind == "hf":
            from sp_plan.runtime.hf import hf_logits

            return hf_logits(self.model, shard["input_ids"], shard["position_ids"], shard.get("cu_seqlens"))
        return self.model(shard["input_ids"], shard["position_ids"], shard.get("cu_seqlens"))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items: int | None = None) -> LossOutput:
        """Token-weighted loss of :meth:`forward`'s logits (see :class:`sp_plan.runtime.loss.TokenLoss`)."""
        return self.loss_fn(logits, labels, num_items)

    def compute_loss(self, shard: Mapping[str, torch.Tensor], num_items: int | None = None) -> LossOutput:
        """Forward and loss of a sharded batch the way the plan says: with ``tiled_loss`` the
        cross-entropy runs chunk by chunk from the final hidden states (the logits never exist whole);
        otherwise :meth:`forward` then :meth:`loss`. ``num_items``: the step's global valid-token count
        under gradient accumulation (:func:`sp_plan.runtime.loss.global_token_count`)."""
        if not self.train.tiled_loss:
            return self.loss(self.forward(shard), shard["labels"], num_items)
        from sp_plan.runtime.tiled_loss import tiled_cross_entropy

        self._grads_synced = False
        hidden = getattr(self.model, hidden_states_method(self.kind))(shard["input_ids"], shard["position_ids"],
                                                                      shard.get("cu_seqlens"))
        tp = self.tensor_parallel
        local_sum, count = tiled_cross_entropy(
            hidden, self.model.lm_head.weight, shard["labels"],
            tp_group=tp.group if tp is not None else None, vocab_start=tp.vocab_start if tp is not None else 0,
        )
        return self.loss_fn.reduce(local_sum, int(count), num_items)

    def sync_gradients(self) -> None:
        """All-reduce the gradients of TP-replicated parameters (norms, replicated K/V) over TP, once per
        optimizer step after the last backward (a no-op without TP or when already done)."""
        if self.tensor_parallel is not None and not self._grads_synced:
            self.tensor_parallel.sync_replicated_grads()
        self._grads_synced = True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip gradients to a global 2-norm (over FSDP shards and TP shards alike); returns the norm."""
        self.sync_gradients()
        if self.tensor_parallel is not None:
            return float(self.tensor_parallel.clip_grad_norm_(self.model, max_norm))
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def grad_norm(self) -> float:
        """The global gradient 2-norm :meth:`clip_grad_norm_` clips by, without clipping: the same value on
        every rank (a NaN or inf on any rank's gradients makes it non-finite everywhere)."""
        self.sync_gradients()
        if self.tensor_parallel is not None:
            return float(self.tensor_parallel.grad_norm(self.model))
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a partial norm over the sharded dims
            norm = norm.full_tensor()
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unparallelised model's parameters (collective: every rank gets all of them), gathered
        over the FSDP shards and the TP shards, keyed like the original model's ``named_parameters``:
        for checkpoints an unparallelised model (or another plan) loads."""
        out = {}
        for name, p in self.model.named_parameters():
            tensor = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.tensor_parallel is not None:
                tensor = self.tensor_parallel.full_tensor(name, tensor)
            out[name] = tensor.detach()
        return out

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """The plan's optimizer over the wrapped model's parameters (``kwargs`` go to ``optimizer_cls``).

        ``offload_optimizer`` alone: :class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer` (fp32 masters
        and states on the host); with ``offload_params`` FSDP2 already keeps parameters, gradients and
        the step on the host, so a plain optimizer runs there. Under TP, :meth:`sync_gradients` runs
        before every ``step()``.
        """
        train = self.train
        if train.offload_optimizer and not train.offload_params:
            from sp_plan.runtime.host_optimizer import HostOffloadOptimizer

            optimizer = HostOffloadOptimizer(self.model.parameters(), optimizer_cls, **kwargs)
        else:
            optimizer = optimizer_cls(self.model.parameters(), **kwargs)
        if self.tensor_parallel is not None:
            optimizer.register_step_pre_hook(lambda *_: self.sync_gradients())
        return optimizer

    def sampler(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        """A DistributedSampler over the data-parallel ranks (SP ranks share samples)."""
        return data_parallel_sampler(dataset, self.mesh, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def describe(self) -> list[str]:
        """Human-readable lines: the layout, options and the prediction the plan was chosen on."""
        return describe_plan(self.plan) + [f"note: {n}" for n in self.notes]


def describe_plan(plan) -> list[str]:
    t, layout = plan.train, plan.layout
    lines = [
        f"plan: {layout.describe()} on {layout.world} rank(s) for {plan.model.name} "
        f"({plan.model.num_params / 1e6:,.1f}M params)",
        f"  seq_len {t.seq_len:,} x micro-batch {t.micro_batch} x grad-accum {t.grad_accum} | {t.dtype} | "
        f"ZeRO-{t.zero_stage} (FSDP2) | checkpointing {t.checkpointing} | optimizer {t.optimizer}"
        + "".join(f" | {name}" for name in TECHNIQUES if getattr(t, name)),
    ]
    est = plan.estimate or {}
    memory, timing = est.get("memory") or {}, est.get("time") or {}
    if memory and timing:
        lines.append(
            f"  predicted on {plan.hardware.topology}: {memory.get('total', 0) / 1e9:.2f} GB per rank, "
            f"step {timing.get('step_s', 0):.3g} s, {timing.get('tokens_per_s', 0):,.0f} tokens/s"
        )
    lines += [f"  why: {reason}" for reason in plan.explanation[:3]]
    return lines


# ----- 0. process group -------------------------------------------------------------------------------------


def init_distributed(device_type: str | None = None) -> str:
    """Initialise the default process group from torchrun's environment (or a 1-rank group); returns
    the device type. NCCL (plus gloo for CPU tensors) on CUDA, gloo on CPU."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise RuntimeConfigError(f"device_type {device_type!r} is not supported: use 'cuda' or 'cpu'")
    if dist.is_initialized():
        return device_type
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_default_group(device_type)
    return device_type


def finish_worker(code: int = 0) -> None:
    """End a torchrun worker: barrier, destroy the process group, flush, and leave without the interpreter's
    teardown (``os._exit``).

    Why not a normal exit: a gloo worker thread releases a finished collective's work object (and with it
    the Python tensors it held) slightly after ``wait()`` has returned on the main thread. If the
    interpreter is finalizing by then, dropping those tensors must take the GIL, CPython ends the thread
    (``PyThread_exit_thread``), and the forced unwind through a ``noexcept`` C++ frame calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT, and torchrun reports the
    finished job as failed. Captured in a core dump (``ProcessGroupGloo::runLoop`` ->
    ``~AsyncBarrierWork`` -> ``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil``
    during ``Py_FinalizeEx``); 1 abort in 180 launches of the 4-rank attention example, about 1 in 15 for
    the training example. ``destroy_process_group`` does not prevent it while any object still refers to
    a group (the device mesh does), so the process leaves before finalization. Files must be closed before
    this (checkpoints, TensorBoard, metrics: the trainer closes them).
    """
    if dist.is_initialized():
        dist.barrier()  # gloo tears down badly if a rank leaves while others still talk
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----- 1. the plan ------------------------------------------------------------------------------------------


def model_spec_of(model: nn.Module) -> tuple[ModelSpec, str]:
    """The cost models' ModelSpec of ``model`` and its kind (``llama``: sp_plan.runtime.models.LlamaModel, ``hf``)."""
    from sp_plan.runtime.models import LlamaModel

    if isinstance(model, LlamaModel):
        return model.spec, "llama"
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        from sp_plan.runtime.hf import hf_model_spec

        return hf_model_spec(model), "hf"
    raise RuntimeConfigError(
        f"auto_configure does not know how to parallelise a {type(model).__name__}: pass a sp_plan.runtime.models.LlamaModel "
        "or a transformers Llama/Qwen2/Qwen3/Mistral causal LM"
    )


def load_topology_for(topology: Any, world: int):
    """A Topology from a Topology, a preset (``dgx-h100``, ``dgx-h100@roce-400:8``) or a topology file."""
    from sp_plan.cost_models.topology import Topology, load_topology

    return topology if isinstance(topology, Topology) else load_topology(str(topology), world)


def probe_topology(world: int, device_type: str):
    """Measure this machine with a quick probe (collective: every rank runs it); the Topology on rank 0."""
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.runtime.probe.run import run_probe

    compute_s, link_s = AUTO_PROBE_BUDGETS[device_type]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_probe(Path(tmp) / "topology.yaml", compute_budget_s=compute_s, link_budget_s=link_s)
        return load_topology(str(result.path), world) if dist.get_rank() == 0 else None


def plan_for(spec: ModelSpec, base: TrainSpec, topology, world: int, *, global_batch: int | None = None,
             fixed_layout: Mapping[str, int] | None = None, fixed_options: Mapping[str, Any] | None = None,
             kind: str = "llama", stack: str | None = None, calibration: str | None = None):
    """Ask the planner for the fastest plan this runtime can execute for a model of ``kind`` (no
    torch.distributed involved), under ``stack`` (default sp-plan) and ``calibration``, with the model
    kind's memory overrides (:data:`sp_plan.runtime.capabilities.MEMORY_ASSUMPTIONS`) on top."""
    from sp_plan.planner.plan import Hardware, Plan
    from sp_plan.planner.search import PlanSettings, search

    layout_pins, option_pins = merge_constraints(fixed_layout or {}, fixed_options or {}, kind, spec)
    sequences = global_batch if global_batch is not None else base.micro_batch
    settings = PlanSettings(global_batch_tokens=sequences * base.seq_len, micro_batch_fixed=True,
                            fixed_layout=layout_pins, fixed_options=option_pins, stack=stack,
                            calibration=calibration, assume=dict(MEMORY_ASSUMPTIONS[kind]))
    result = search(spec, base, topology, settings, world=world)
    best = result.best
    hardware = Hardware(num_gpus=world, gpus_per_node=min(topology.gpus_per_node, world), gpu=topology.gpu.name,
                        topology=topology.name)
    runner_up = result.plans[1] if len(result.plans) > 1 else None
    explanation = [f"fastest of {result.stats.layouts} layouts the runtime can execute "
                   f"({best.estimate.time.tokens_per_s:,.0f} tokens/s predicted)"]
    if runner_up is not None:
        explanation.append(f"next best: {runner_up.layout.describe()} "
                           f"({runner_up.estimate.time.tokens_per_s:,.0f} tokens/s)")
    est = best.estimate.to_json_dict()
    return Plan(model=spec, train=best.train, layout=best.layout, hardware=hardware, estimate=est,
                placement=est.get("placement") or {}, explanation=explanation, stack=result.stack,
                calibration=result.calibration)


def _plan_from_argument(plan: Any):
    from sp_plan.planner.plan import Plan, load_plan, plan_from_dict

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return plan_from_dict(dict(plan), "plan")
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise RuntimeConfigError(f"plan must be a Plan, a mapping or a path to a plan file, got {type(plan).__name__}")


def _plan_digest(plan) -> str:
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()


def agree_on_plan(make_plan) -> Any:
    """Run ``make_plan()`` on rank 0, broadcast the result (or its error) and check every rank holds it."""
    from sp_plan.planner.plan import plan_from_dict

    world = dist.get_world_size()
    if world == 1:
        return make_plan()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", make_plan().model_dump(mode="json"))
        except Exception as exc:  # every rank must learn why, not hang in the broadcast
            payload[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise RuntimeConfigError(f"rank 0 could not make a plan: {value}")
    plan = plan_from_dict(value, "the plan broadcast by rank 0")
    check_same_plan(plan)
    return plan


def check_same_plan(plan) -> None:
    """Raise on every rank if the ranks do not hold identical plans (e.g. different plan files per node)."""
    world = dist.get_world_size()
    if world == 1:
        return
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _plan_digest(plan))
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeConfigError(
            f"ranks {differ} hold a different plan than rank 0: give every rank the same plan file (or plan=None "
            "to let rank 0 decide)"
        )


def check_plan_matches(plan, spec: ModelSpec, seq_len: int | None) -> None:
    """A plan made for another architecture or sequence length would mis-size everything: refuse it."""
    differ = [f"{name}: plan {getattr(plan.model, name)!r} vs model {getattr(spec, name)!r}"
              for name in ARCHITECTURE_FIELDS if getattr(plan.model, name) != getattr(spec, name)]
    if differ:
        raise RuntimeConfigError(
            f"the plan was made for {plan.model.name}, not this model ({'; '.join(differ[:3])}): re-plan for this "
            "model (or pass plan=None)"
        )
    if seq_len is not None and seq_len != plan.train.seq_len:
        raise RuntimeConfigError(
            f"seq_len={seq_len} but the plan is for {plan.train.seq_len} tokens: pass seq_len={plan.train.seq_len} "
            "(or omit it), or re-plan"
        )


def refuse_unsupported(plan, kind: str = "llama") -> None:
    reasons = unsupported_reasons(plan, kind)
    if reasons:
        raise RuntimeConfigError(
            f"the runtime cannot execute this plan ({len(reasons)} option(s)): " + " | ".join(reasons)
        )


# ----- 3-7. model surgery -------------------------------------------------------------------------------


def _data_group(mesh: RuntimeMesh) -> dist.ProcessGroup | None:
    """Every rank that holds different tokens: all mesh dims but tp (the whole world without TP, which
    needs no extra communicator)."""
    dims = ("dp_replicate", "dp_shard", "ring", "ulysses")
    if all(mesh.size(d) == 1 for d in dims):
        return None
    if mesh.size("tp") == 1:
        return dist.group.WORLD
    return mesh.device_mesh[dims]._flatten("data").get_group()


def swap_attention(model: nn.Module, kind: str, sp: SequenceParallel, seq_len: int) -> None:
    if kind == "hf":
        from sp_plan.runtime.hf import use_sequence_parallel_attention

        use_sequence_parallel_attention(model, sp, seq_len)
        return
    attention = SequenceParallelAttention(sp)
    model.attention_fn = attention
    for layer in model.layers:
        layer.attn.attention_fn = attention


def apply_tensor_parallelism(model: nn.Module, kind: str, plan, mesh: RuntimeMesh):
    """Shard the projections, vocabulary and loss over the ``tp`` dim; the TensorParallel state or None."""
    if plan.layout.tp == 1:
        return None
    refuse_unsupported(plan, kind)
    if kind == "hf":
        from sp_plan.runtime.hf import apply_hf_tensor_parallel

        return apply_hf_tensor_parallel(model, mesh, sequence_parallel=plan.train.tp_sequence_parallel)
    from sp_plan.runtime.tp import apply_tensor_parallel

    return apply_tensor_parallel(model, mesh, sequence_parallel=plan.train.tp_sequence_parallel)


def apply_checkpointing(model: nn.Module, kind: str, train: TrainSpec):
    """Checkpointing mode per block and, with ``offload_checkpoints``, the host offload of each block's
    checkpointed input; returns the CheckpointOffload or None."""
    from sp_plan.runtime.offload import CheckpointOffload, apply_checkpoint_offload

    if kind == "hf":
        from sp_plan.runtime.hf import set_hf_checkpointing

        offload = CheckpointOffload() if train.offload_checkpoints else None
        set_hf_checkpointing(model, train.checkpointing, offload)
        return offload
    model.set_checkpointing(train.checkpointing)
    return apply_checkpoint_offload(model) if train.offload_checkpoints else None


def apply_tiled_mlp_if_planned(model: nn.Module, kind: str, plan) -> None:
    if plan.train.tiled_mlp:
        refuse_unsupported(plan, kind)
        if kind == "hf":
            from sp_plan.runtime.hf import apply_hf_tiled_mlp

            apply_hf_tiled_mlp(model)
            return
        from sp_plan.runtime.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model)


def hidden_states_method(kind: str) -> str:
    """The model method returning the final hidden states (the tiled loss's input)."""
    if kind == "hf":
        from sp_plan.runtime.hf import HIDDEN_STATES_METHOD

        return HIDDEN_STATES_METHOD
    return "hidden_states"


def transformer_blocks(model: nn.Module, kind: str) -> list[nn.Module]:
    if kind == "hf":
        from sp_plan.runtime.hf import hf_decoder_layers

        return hf_decoder_layers(model)
    return list(model.layers)


def input_embedding(model: nn.Module, kind: str) -> nn.Module:
    return model.get_input_embeddings() if kind == "hf" else model.embed_tokens


def shard_model(model: nn.Module, kind: str, plan, mesh: RuntimeMesh) -> nn.Module:
    """FSDP2 per block, untied input embedding, and root (:func:`sp_plan.runtime.fsdp.fully_shard_units`), with
    the plan's mixed precision, ZeRO stage and parameter offload; the tiled loss's hidden-states method
    registered as an FSDP forward method (so the root's norm and lm_head are gathered around it)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    train = plan.train
    in_compute_dtype = needs_compute_dtype_params(train)
    if in_compute_dtype:
        # No fp32 master copy on the device: adamw_bf16 has none, offload_optimizer keeps it on the host.
        model.to(COMPUTE_DTYPES[train.dtype])
    if train.tiled_loss and kind == "hf":
        from sp_plan.runtime.hf import add_hidden_states_method

        add_hidden_states_method(model)
    kwargs = fully_shard_kwargs(train, mesh, params_in_compute_dtype=in_compute_dtype)
    embedding = None if plan.model.tied_embeddings else input_embedding(model, kind)
    fully_shard_units(model, transformer_blocks(model, kind), embedding, kwargs, sum_gradients=True)
    if train.tiled_loss:
        register_fsdp_forward_method(model, hidden_states_method(kind))
    return model


def broadcast_parameters(model: nn.Module, device: torch.device) -> None:
    """Make every rank start from rank 0's weights (FSDP2 keeps each rank's own slice of its own copy)."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if tensor.device.type == "meta":
                raise RuntimeConfigError(
                    "the model has meta-device tensors: materialise it (same seed on every rank) before "
                    "auto_configure, or pass sync_weights=False and initialise after sharding"
                )
            staged = tensor.detach().to(device)
            dist.broadcast(staged, src=0)
            tensor.copy_(staged)


# ----- the one call -------------------------------------------------------------------------------------


def auto_configure(
    model: nn.Module,
    *,
    seq_len: int | None = None,
    micro_batch: int = 1,
    plan: Any = None,
    topology: Any = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    global_batch: int | None = None,
    fixed_layout: Mapping[str, int] | None = None,
    fixed_options: Mapping[str, Any] | None = None,
    device_type: str | None = None,
    pad_token_id: int = 0,
    labels_shifted: bool = False,
    cross_document_attention: bool = False,
    sync_weights: bool = True,
    tp_sequence_parallel: bool = True,
    stack: str | None = None,
    calibration: str | None = None,
    document_length: int | None = None,
) -> AutoConfigured:
    """Plan (or load the plan), build the mesh, swap in SP attention, checkpoint, shard with FSDP2.

    ``model``: a :class:`sp_plan.runtime.models.LlamaModel` or an HF Llama/Qwen2/Qwen3/Mistral causal LM, on CPU
    (it is moved to the rank's device), identically initialised on every rank (``sync_weights``
    broadcasts rank 0's weights to make sure). ``plan``: a Plan, a plan file or None (plan here).
    When planning: ``seq_len``, ``micro_batch``, ``dtype`` (default bf16 on CUDA, fp32 on CPU) and
    ``optimizer`` describe the run; ``global_batch`` is the number of sequences per optimizer step
    (default: one micro-batch, no accumulation); ``fixed_layout``/``fixed_options`` pin degrees or
    options (e.g. ``{"ulysses": 4}``, ``{"tiled_loss": True}``); ``tp_sequence_parallel``: Megatron
    sequence parallelism when the plan uses TP; ``topology`` is a Topology, a preset or topology file, or
    None to probe this machine; ``stack`` (a stack name or YAML file, default ``sp-plan``) and
    ``calibration`` (a calibration file) are what the planner assumes, with the model kind's memory
    overrides on top; ``document_length`` (typical tokens per document of packed, document-masked rows)
    lets the planner price attention for packed data. The data arguments configure the
    :class:`sp_plan.runtime.data.BatchSharder`.
    """
    device_type = init_distributed(device_type)
    world = dist.get_world_size()
    spec, kind = model_spec_of(model)
    if plan is None:
        if seq_len is None:
            raise RuntimeConfigError("auto_configure needs seq_len=... (or a plan) to plan the run")
        try:
            base = TrainSpec(seq_len=seq_len, micro_batch=micro_batch,
                             dtype=dtype or ("bf16" if device_type == "cuda" else "fp32"), optimizer=optimizer,
                             tp_sequence_parallel=tp_sequence_parallel, document_length=document_length)
        except ValueError as exc:
            raise RuntimeConfigError(f"invalid training options: {exc}".splitlines()[0]) from None
        probed = probe_topology(world, device_type) if topology is None else None  # collective

        def make_plan():  # rank 0 only: its errors (a bad topology name, no plan fits) reach every rank
            topo = probed if topology is None else load_topology_for(topology, world)
            return plan_for(spec, base, topo, world, global_batch=global_batch, fixed_layout=fixed_layout,
                            fixed_options=fixed_options, kind=kind, stack=stack, calibration=calibration)

        the_plan = agree_on_plan(make_plan)
    else:
        the_plan = _plan_from_argument(plan)
        check_same_plan(the_plan)
    check_plan_matches(the_plan, spec, seq_len)
    refuse_unsupported(the_plan, kind)

    train = the_plan.train
    mesh = build_mesh(the_plan.layout, device_type=device_type)
    sp = SequenceParallel.from_mesh(mesh)
    model.to(mesh.device)
    if sync_weights:
        broadcast_parameters(model, mesh.device)
    tp = apply_tensor_parallelism(model, kind, the_plan, mesh)  # on the full, synchronised weights
    swap_attention(model, kind, sp, train.seq_len)
    offload = apply_checkpointing(model, kind, train)
    apply_tiled_mlp_if_planned(model, kind, the_plan)
    model = shard_model(model, kind, the_plan, mesh)
    data_group = _data_group(mesh)
    tp_splits_sequence = tp is not None and tp.sequence_parallel
    sharder = BatchSharder(sp, pad_token_id=pad_token_id, labels_shifted=labels_shifted,
                           cross_document_attention=cross_document_attention, device=mesh.device,
                           tp_multiple=the_plan.layout.tp if tp_splits_sequence else 1)
    cross_entropy = tp.cross_entropy if tp is not None else None  # vocab-parallel logits under TP
    return AutoConfigured(model=model, plan=the_plan, mesh=mesh, sp=sp, sharder=sharder,
                          loss_fn=TokenLoss(data_group, cross_entropy), data_group=data_group, kind=kind,
                          compute_dtype=COMPUTE_DTYPES[train.dtype], tensor_parallel=tp,
                          checkpoint_offload=offload)
