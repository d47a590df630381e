"""``auto_configure``: from "this model, this sequence length, these GPUs" to a sequence-parallel run.

Inside a torchrun launch (or a single process), one call::

    setup = auto_configure(model, seq_len=131072)
    for batch in loader:                                   # full-sequence batches (see sp_plan.runtime.data)
        shard = setup.shard(batch)                         # pre-shifted, padded, this rank's shard
        out = setup.loss(setup.forward(shard), shard["labels"])
        out.loss.backward()

does, in order (each step a small function elsewhere, so later techniques slot in locally: the plan in
:mod:`sp_plan.runtime.planning`, the process group in :mod:`sp_plan.runtime.distributed`, the model
surgery in :func:`sp_plan.runtime.parallelize.parallelize`, through the model family's
:class:`~sp_plan.runtime.models.base.ModelAdapter` found by :func:`~sp_plan.runtime.models.base.adapter_for`):

1. **plan**: a :class:`sp_plan.planner.plan.Plan`, a plan file, or None: rank 0 asks the planner, for the
   topology given (a Topology, a preset/file name) or probed on the spot, restricted to what this
   runtime can execute for the model's family (:mod:`sp_plan.runtime.capabilities`); the plan is broadcast and every rank checks
   that it holds the same plan (a hash of its JSON);
2. **refuse** options the runtime cannot execute (:func:`sp_plan.runtime.capabilities.unsupported_reasons`),
   and a plan made for another model or sequence length;
3. **mesh**: :func:`sp_plan.runtime.mesh.build_mesh` (5-D DeviceMesh + ``sp``/``fsdp`` dims) and a ``data``
   group (every rank but TP) for the loss;
4. **tensor parallelism** (:mod:`sp_plan.runtime.tp`, Megatron column/row split with sequence parallelism
   per the plan's ``tp_sequence_parallel``) on the full, rank-0-synchronised weights, before anything
   shards them further;
5. **attention**: the model's attention becomes the planned SP attention
   (:class:`sp_plan.runtime.context.SequenceParallel`): our :class:`~sp_plan.runtime.models.LlamaModel` through its
   ``attention_fn``, HF models through transformers' attention registry (:mod:`sp_plan.runtime.models.hf`);
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
  gradients reduce-scattered every micro-batch (under pipeline stages the schedule drives FSDP2 instead:
  gathered once per stage and step, reduced after the last micro-batch, as torchtitan runs it);
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

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_plan.cost_models.data_balance import DataShape
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.runtime.context import SequenceParallel
from sp_plan.runtime.data import BatchSharder, data_parallel_coordinates, data_parallel_sampler
from sp_plan.runtime.distributed import broadcast_parameters, data_group, finish_worker, init_distributed
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.fsdp import DTYPES, clip_sharded_grads_, sharded_grad_norm
from sp_plan.runtime.host_optimizer import HostOffloadOptimizer
from sp_plan.runtime.loss import LossOutput, TokenLoss
from sp_plan.runtime.mesh import RuntimeMesh, build_mesh
from sp_plan.runtime.models.base import ModelAdapter, adapter_for
from sp_plan.runtime.models.llama.attention import SequenceParallelAttention
from sp_plan.runtime.model_parts import split_model
from sp_plan.runtime.parallelize import parallelize
from sp_plan.runtime.pipeline import (
    build_pipeline,
    clip_to_norm_,
    gather_stage_state_dicts,
    norm_over_stages,
    stage_bounds,
    stage_indices,
)
from sp_plan.runtime.planning import (
    agree_on_plan,
    check_plan_matches,
    check_same_plan,
    describe_plan,
    load_topology_for,
    plan_for,
    plan_from_argument,
    plan_sharding,
    probe_topology,
    refuse_unsupported,
)
from sp_plan.runtime.tiled_loss import tiled_cross_entropy
from sp_plan.runtime.tp import clip_parts_grad_norm_, parts_grad_norm

COMPUTE_DTYPES = DTYPES

#: Names that moved to :mod:`sp_plan.runtime.distributed`, :mod:`sp_plan.runtime.planning` and
#: :mod:`sp_plan.runtime.models.llama.attention`, importable from here as before.
__all__ = [
    "AutoConfigured",
    "SequenceParallelAttention",
    "agree_on_plan",
    "auto_configure",
    "check_plan_matches",
    "check_same_plan",
    "configure_parts",
    "configure_pipeline",
    "describe_plan",
    "finish_worker",
    "init_distributed",
    "plan_for",
]


# ----- the result ------------------------------------------------------------------------------------------


@dataclass
class AutoConfigured:
    """What :func:`auto_configure` built. ``model_parts`` are the wrapped (FSDP2) model parts (the whole model,
    or under pipeline parallelism this rank's stages), ``adapter`` the model family that drives them."""

    model_parts: list[nn.Module]
    plan: Any  # sp_plan.planner.plan.Plan
    mesh: RuntimeMesh
    sp: SequenceParallel
    sharder: BatchSharder
    loss_fn: TokenLoss
    data_group: dist.ProcessGroup | None
    adapter: ModelAdapter
    compute_dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    #: The TP state (sp_plan.runtime.tp.TensorParallel) when the plan has tp > 1, else None: the last
    #: part's (the vocab-parallel loss's); every part shards by the same rules (checkpoint geometry).
    tensor_parallel: Any = None
    #: The checkpoint offload (sp_plan.runtime.offload.CheckpointOffload) when the plan offloads checkpoints.
    checkpoint_offload: Any = None
    #: Each model part's TP state (its replicated parameters), in part order; empty without TP.
    part_tensor_parallel: list[Any] = field(default_factory=list)
    #: This rank's pipeline stage and schedule (sp_plan.runtime.pipeline.Pipeline) when the plan has pp > 1:
    #: ``model_parts`` then hold this stage's part only, and :func:`sp_plan.runtime.step.train_step` runs the
    #: step through the schedule.
    pipeline: Any = None
    #: The topology auto_configure probed to plan on (rank 0; None elsewhere, or when the plan or topology was
    #: given): what :mod:`sp_plan.runtime.host_overhead` prices the short run on.
    probed_topology: Any = None
    #: Set when TP-replicated gradients were all-reduced; cleared by every forward (new gradients).
    _grads_synced: bool = field(default=False, repr=False)

    # -- convenience -----------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The first model part: the whole (wrapped) model while there is one part."""
        return self.model_parts[0]

    @property
    def kind(self) -> str:
        """The model family's registered name (``llama``, ``hf``, ...)."""
        return self.adapter.name

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

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every model part's parameters, part after part."""
        return itertools.chain.from_iterable(part.parameters() for part in self.model_parts)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every model part's named parameters (each part keeps the whole model's names)."""
        return itertools.chain.from_iterable(part.named_parameters() for part in self.model_parts)

    def _through_parts(self, shard: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run every model part but the last on the shard's tokens: what the last part takes (the token
        ids with one part, else the hidden states the previous parts computed)."""
        if self.pipeline is not None:
            raise RuntimeConfigError(
                "this setup is one stage of a pipeline (pp > 1): a forward runs through every stage's schedule; "
                "train with sp_plan.runtime.step.train_step (or the Trainer)"
            )
        self._grads_synced = False
        x = shard["input_ids"]
        for part in self.model_parts[:-1]:
            x = self.adapter.logits(part, x, shard["position_ids"], shard.get("cu_seqlens"))
        return x

    def pipeline_step(self, shards: Sequence[Mapping[str, torch.Tensor]], step_tokens: int) -> list[tuple[float, int]]:
        """Forward and backward of a step's micro-batch shards through the pipeline schedule (``pp > 1``); each
        micro-batch's (global token-mean loss, global valid tokens). New gradients: TP-replicated ones need
        their all-reduce again (:meth:`sync_gradients`)."""
        self._grads_synced = False
        return self.pipeline.run_step(shards, step_tokens, self.data_group, self.device)

    def shard(self, batch: Any) -> dict[str, torch.Tensor]:
        """This rank's shard of a full-sequence batch (see :class:`sp_plan.runtime.data.BatchSharder`)."""
        return self.sharder(batch)

    def forward(self, shard: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits of this rank's tokens for a sharded batch (global position ids, no mask); under tensor
        parallelism this rank's vocabulary slice (:meth:`loss` knows). Materialises the logits even when
        the plan has ``tiled_loss``: train with :meth:`compute_loss`."""
        x = self._through_parts(shard)
        return self.adapter.logits(self.model_parts[-1], x, shard["position_ids"], shard.get("cu_seqlens"))

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
        x = self._through_parts(shard)
        model = self.model_parts[-1]
        hidden = self.adapter.hidden_states(model, x, shard["position_ids"], shard.get("cu_seqlens"))
        tp = self.tensor_parallel
        local_sum, count = tiled_cross_entropy(
            hidden, self.adapter.lm_head_weight(model), shard["labels"],
            tp_group=tp.group if tp is not None else None, vocab_start=tp.vocab_start if tp is not None else 0,
        )
        return self.loss_fn.reduce(local_sum, int(count), num_items)

    def sync_gradients(self) -> None:
        """All-reduce the gradients of TP-replicated parameters (norms, replicated K/V) over TP, once per
        optimizer step after the last backward (a no-op without TP or when already done)."""
        if not self._grads_synced:
            for tp in self.part_tensor_parallel:
                tp.sync_replicated_grads()
        self._grads_synced = True

    def _tp_parts(self) -> list[tuple[Any, nn.Module]]:
        return list(zip(self.part_tensor_parallel, self.model_parts))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip gradients of every model part to one global 2-norm (over FSDP shards, TP shards and pipeline
        stages alike); returns the norm."""
        self.sync_gradients()
        if self.pipeline is not None:
            total = norm_over_stages(self._local_grad_norm(), self.pipeline.group, self.device)
            return clip_to_norm_(list(self.parameters()), max_norm, total)
        if self.part_tensor_parallel:
            return float(clip_parts_grad_norm_(self._tp_parts(), max_norm))
        if self.layout.ep > 1:  # experts on their own mesh: torch's clip_grad_norm_ takes one
            return clip_sharded_grads_(self.parameters(), max_norm, self._local_grad_norm())
        return float(torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm))

    def grad_norm(self) -> float:
        """The global gradient 2-norm :meth:`clip_grad_norm_` clips by, without clipping: the same value on
        every rank (a NaN or inf on any rank's gradients makes it non-finite everywhere)."""
        self.sync_gradients()
        norm = self._local_grad_norm()
        if self.pipeline is not None:
            norm = norm_over_stages(norm, self.pipeline.group, self.device)
        return float(norm)

    def _local_grad_norm(self) -> torch.Tensor:
        """The 2-norm of this rank's model parts' gradients, over their FSDP and TP shards (every stage of a
        pipeline has its own)."""
        if self.part_tensor_parallel:
            return parts_grad_norm(self._tp_parts())
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return sharded_grad_norm(grads)  # FSDP2: partial norms over the sharded dims (experts: their own mesh)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unparallelised model's parameters (collective: every rank gets all of them), gathered
        over the FSDP shards and the TP shards, keyed like the original model's ``named_parameters``:
        for checkpoints an unparallelised model (or another plan) loads. Under pipeline parallelism, every
        stage's parameters, gathered over the ``pp`` group (on the host)."""
        out = {}
        for name, p in self.named_parameters():
            tensor = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.tensor_parallel is not None:
                tensor = self.tensor_parallel.full_tensor(name, tensor)
            out[name] = tensor.detach()
        if self.pipeline is not None:
            return gather_stage_state_dicts(out, self.pipeline.group)
        return out

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """The plan's optimizer over the wrapped model parts' parameters (``kwargs`` go to ``optimizer_cls``).

        ``offload_optimizer`` alone: :class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer` (fp32 masters
        and states on the host); with ``offload_params`` FSDP2 already keeps parameters, gradients and
        the step on the host, so a plain optimizer runs there. Under TP, :meth:`sync_gradients` runs
        before every ``step()``.
        """
        train = self.train
        if train.offload_optimizer and not train.offload_params:
            optimizer = HostOffloadOptimizer(self.parameters(), optimizer_cls, **kwargs)
        else:
            optimizer = optimizer_cls(self.parameters(), **kwargs)
        if self.tensor_parallel is not None:
            optimizer.register_step_pre_hook(lambda *_: self.sync_gradients())
        return optimizer

    def sampler(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        """A DistributedSampler over the data-parallel ranks (SP ranks share samples)."""
        return data_parallel_sampler(dataset, self.mesh, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def describe(self) -> list[str]:
        """Human-readable lines: the layout, options and the prediction the plan was chosen on."""
        return describe_plan(self.plan) + [f"note: {n}" for n in self.notes]


# ----- the one call -------------------------------------------------------------------------------------


def _training_spec(seq_len: int | None, micro_batch: int, dtype: str | None, device_type: str, optimizer: str,
                   tp_sequence_parallel: bool, document_length: int | None, data: DataShape | None) -> TrainSpec:
    """The run the planner plans for, from auto_configure's arguments (bf16 on CUDA, fp32 on CPU by default)."""
    if seq_len is None:
        raise RuntimeConfigError("auto_configure needs seq_len=... (or a plan) to plan the run")
    try:
        return TrainSpec(seq_len=seq_len, micro_batch=micro_batch,
                         dtype=dtype or ("bf16" if device_type == "cuda" else "fp32"), optimizer=optimizer,
                         tp_sequence_parallel=tp_sequence_parallel, document_length=document_length, data=data)
    except ValueError as exc:
        raise RuntimeConfigError(f"invalid training options: {exc}".splitlines()[0]) from None


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
    data: DataShape | None = None,
    sharding: str | None = "zigzag",
) -> AutoConfigured:
    """Plan (or load the plan), build the mesh, swap in SP attention, checkpoint, shard with FSDP2.

    ``model``: a :class:`sp_plan.runtime.models.LlamaModel`, an HF Llama/Qwen2/Qwen3/Mistral causal LM, or
    a model of a family registered with :func:`sp_plan.runtime.models.register_adapter`, on CPU
    (it is moved to the rank's device), identically initialised on every rank (``sync_weights``
    broadcasts rank 0's weights to make sure). ``plan``: a Plan, a plan file or None (plan here).
    When planning: ``seq_len``, ``micro_batch``, ``dtype`` (default bf16 on CUDA, fp32 on CPU) and
    ``optimizer`` describe the run; ``global_batch`` is the number of sequences per optimizer step
    (default: one micro-batch, no accumulation); ``fixed_layout``/``fixed_options`` pin degrees or
    options (e.g. ``{"ulysses": 4}``, ``{"tiled_loss": True}``); ``tp_sequence_parallel``: Megatron
    sequence parallelism when the plan uses TP; ``topology`` is a Topology, a preset or topology file, or
    None to probe this machine; ``stack`` (a stack name or YAML file, default ``sp-plan``) and
    ``calibration`` (a calibration file) are what the planner assumes, with the model family's memory
    overrides on top; ``document_length`` (typical tokens per document of packed, document-masked rows)
    lets the planner price attention for packed data; ``data`` (the dataset's document lengths, packing and
    sharding rule, :class:`~sp_plan.cost_models.data_balance.DataShape`) prices the packed rows themselves.
    ``sharding``: how the ring splits a row (:class:`~sp_plan.runtime.context.SequenceParallel`), ``"zigzag"``
    (the default), ``"per_document"``, or None for the plan's own rule (:func:`plan_sharding`: the rule its
    data shape resolves to at its ring degree, zigzag without one). The data arguments configure the
    :class:`sp_plan.runtime.data.BatchSharder`.
    """
    device_type = init_distributed(device_type)
    world = dist.get_world_size()
    adapter = adapter_for(model)
    spec = adapter.spec(model)
    if plan is None:
        base = _training_spec(seq_len, micro_batch, dtype, device_type, optimizer, tp_sequence_parallel,
                              document_length, data)
        probed = probe_topology(world, device_type) if topology is None else None  # collective

        def make_plan():  # rank 0 only: its errors (a bad topology name, no plan fits) reach every rank
            topo = probed if topology is None else load_topology_for(topology, world)
            return plan_for(spec, base, topo, world, global_batch=global_batch, fixed_layout=fixed_layout,
                            fixed_options=fixed_options, family=adapter, stack=stack, calibration=calibration)

        the_plan = agree_on_plan(make_plan)
    else:
        the_plan = plan_from_argument(plan)
        check_same_plan(the_plan)
    check_plan_matches(the_plan, spec, seq_len)
    refuse_unsupported(the_plan, adapter)

    options = {"pad_token_id": pad_token_id, "labels_shifted": labels_shifted,
               "cross_document_attention": cross_document_attention,
               "sharding": plan_sharding(the_plan) if sharding is None else sharding}
    if the_plan.layout.pp > 1:
        setup = configure_pipeline(model, adapter, the_plan, device_type=device_type, sync_weights=sync_weights,
                                   **options)
    else:
        setup = configure_parts([model], adapter, the_plan, device_type=device_type, sync_weights=sync_weights,
                                **options)
    if plan is None and topology is None:
        setup.probed_topology = probed
    return setup


def configure_pipeline(model: nn.Module, adapter: ModelAdapter, plan: Any, *, device_type: str | None = None,
                       sync_weights: bool = True, **options: Any) -> AutoConfigured:
    """The setup of a pipelined plan (``pp > 1``) on this rank: the whole model's weights made the same on every
    rank, the model split into the stages the cost model priced (:func:`sp_plan.runtime.pipeline.stage_bounds`),
    this rank's stages (one per virtual stage, from its ``pp`` coordinate) parallelised as model parts
    (:func:`configure_parts`), and their PipelineStages with the plan's schedule
    (:func:`sp_plan.runtime.pipeline.build_pipeline`).
    ``options``: :func:`configure_parts`'s data arguments."""
    device_type = init_distributed(device_type)
    refuse_unsupported(plan, adapter)
    mesh = build_mesh(plan.layout, device_type=device_type)
    model = model.to(mesh.device)
    if sync_weights:
        broadcast_parameters([model], mesh.device)  # before the split: every rank holds the whole model here
    parts = split_model(model, adapter, stage_bounds(plan))
    mine = [parts[i] for i in stage_indices(plan, mesh.local_rank("pp"))]
    setup = _configure_on_mesh(mine, adapter, plan, mesh, **options)
    setup.pipeline = build_pipeline(setup.model_parts, adapter, plan, mesh, _stage_cross_entropy(setup))
    return setup


def _stage_cross_entropy(setup: AutoConfigured):
    """The last stage's ``(output, labels) -> (token-loss sum, valid tokens)``: the tiled cross-entropy from
    the final hidden states under the plan's ``tiled_loss`` (the lm_head of the rank's last part, the loss
    stage's), else the vocab-parallel one under TP, else None (whole-logits cross-entropy)."""
    tp = setup.tensor_parallel
    if setup.train.tiled_loss:
        head = setup.model_parts[-1]

        def tiled(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
            return tiled_cross_entropy(hidden, setup.adapter.lm_head_weight(head), labels,
                                       tp_group=tp.group if tp is not None else None,
                                       vocab_start=tp.vocab_start if tp is not None else 0)
        return tiled
    return tp.cross_entropy if tp is not None else None


def configure_parts(
    model_parts: Sequence[nn.Module],
    adapter: ModelAdapter,
    plan: Any,
    *,
    device_type: str | None = None,
    pad_token_id: int = 0,
    labels_shifted: bool = False,
    cross_document_attention: bool = False,
    sync_weights: bool = True,
    sharding: str = "zigzag",
) -> AutoConfigured:
    """The setup of a plan over model parts (:func:`auto_configure`'s second half): the mesh, then each part
    parallelised in turn (:func:`sp_plan.runtime.parallelize.parallelize`: TP, SP attention, checkpointing,
    tiled MLP, FSDP2), the batch sharder and the loss. ``model_parts``: the whole model, or the parts of
    :func:`sp_plan.runtime.model_parts.split_model` (run in order by :meth:`AutoConfigured.forward`; pipeline
    stages on separate ranks are :func:`configure_pipeline`'s); ``plan`` must already be agreed on by every
    rank and checked against the model (:func:`auto_configure` does both). The other arguments are
    :func:`auto_configure`'s."""
    device_type = init_distributed(device_type)
    refuse_unsupported(plan, adapter)
    mesh = build_mesh(plan.layout, device_type=device_type)
    parts_on_device = [part.to(mesh.device) for part in model_parts]
    if sync_weights:
        broadcast_parameters(parts_on_device, mesh.device)
    return _configure_on_mesh(parts_on_device, adapter, plan, mesh, pad_token_id=pad_token_id,
                              labels_shifted=labels_shifted, cross_document_attention=cross_document_attention,
                              sharding=sharding)


def _configure_on_mesh(parts_on_device: Sequence[nn.Module], adapter: ModelAdapter, plan: Any, mesh: RuntimeMesh, *,
                       pad_token_id: int = 0, labels_shifted: bool = False,
                       cross_document_attention: bool = False, sharding: str = "zigzag") -> AutoConfigured:
    """:func:`configure_parts` once the mesh exists and the parts' weights agree: parallelise each part, then
    the batch sharder and the loss (the ring splitting rows by ``sharding``)."""
    sp = SequenceParallel.from_mesh(mesh, sharding=sharding)
    parts = [parallelize(part, adapter, plan, mesh, sp) for part in parts_on_device]
    part_tp = [p.tensor_parallel for p in parts if p.tensor_parallel is not None]
    tp = part_tp[-1] if part_tp else None  # the vocab-parallel loss's: the last part's
    offloads = [p.checkpoint_offload for p in parts if p.checkpoint_offload is not None]
    if len(offloads) > 1:
        raise RuntimeConfigError(
            "offload_checkpoints over more than one model part is not implemented (each part would keep its own "
            "host buffers, which the memory model does not price): plan without offload_checkpoints"
        )
    group = data_group(mesh)
    tp_splits_sequence = tp is not None and tp.sequence_parallel
    sharder = BatchSharder(sp, pad_token_id=pad_token_id, labels_shifted=labels_shifted,
                           cross_document_attention=cross_document_attention, device=mesh.device,
                           tp_multiple=plan.layout.tp if tp_splits_sequence else 1)
    cross_entropy = tp.cross_entropy if tp is not None else None  # vocab-parallel logits under TP
    return AutoConfigured(model_parts=[p.module for p in parts], plan=plan, mesh=mesh, sp=sp, sharder=sharder,
                          loss_fn=TokenLoss(group, cross_entropy), data_group=group, adapter=adapter,
                          compute_dtype=COMPUTE_DTYPES[plan.train.dtype], tensor_parallel=tp,
                          checkpoint_offload=offloads[0] if offloads else None, part_tensor_parallel=part_tp)
