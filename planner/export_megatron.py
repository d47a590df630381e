"""``sp-plan export --to megatron``: a plan as the arguments of Megatron-LM's ``pretrain_gpt.py``.

The flag names are Megatron-LM's own (``megatron/training/arguments.py`` at core_v0.16.1, whose model and
parallelism flags are generated from megatron-core's ``TransformerConfig`` / ``ModelParallelConfig`` /
``DistributedDataParallelConfig`` fields); tests/test_export_megatron.py builds those megatron-core configs
from the exported arguments, and runs Megatron-LM's own ``parse_args`` + ``validate_args`` where a Megatron-LM
checkout is importable. How sp-plan's plan maps onto Megatron:

- layout: ``tp`` -> ``--tensor-model-parallel-size`` (with ``--sequence-parallel``, Megatron SP);
  ``ulysses x ring`` -> ``--context-parallel-size`` with ``--cp-comm-type`` ``p2p`` (ring only: Megatron's
  load-balanced P2P ring), ``a2a`` (Ulysses only) or ``a2a+p2p`` with ``--hierarchical-context-parallel-sizes
  ulysses ring`` (USP: the a2a level is the inner, adjacent ranks, as in sp-plan's mesh); data parallel is
  what is left (Megatron's rank order tp-cp-dp matches sp-plan's mesh, tp innermost); ``dp_replicate`` ->
  ``--num-distributed-optimizer-instances`` (the optimizer sharded within each instance, replicated across);
  ``pp`` -> ``--pipeline-model-parallel-size`` (interleaved 1F1B: ``--num-virtual-stages-per-pipeline-rank``;
  a first or last stage with other layers than the middle ones: ``--decoder-first/last-pipeline-num-layers``,
  Megatron splitting the rest evenly; with virtual stages, a first or last stage one layer short of the others
  because the embedding or the loss fills a model chunk's layer slot: ``--account-for-embedding-in-pipeline-split``
  / ``--account-for-loss-in-pipeline-split``, as Megatron-Bridge's Llama 3.1 405B recipe runs 126 layers over 8
  stages of 8 chunks); ``ep`` -> ``--expert-model-parallel-size`` (Megatron's expert ranks
  are ``ep`` consecutive ranks after TP, carved from the context x data-parallel ranks: the planner's ``ep``
  innermost shard-group ranks; expert TP stays the dense TP, Megatron's default).
- mixture of experts -> ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``, the shared
  experts' width, ``--moe-layer-freq`` for the dense layers (a pattern Megatron evaluates), dropless routing or
  ``--moe-expert-capacity-factor`` with padding (the planner prices padded capacity), grouped GEMMs and the
  all-to-all token dispatcher (what the cost model prices). The router's score function and group-limited
  routing are the model recipe's, not the plan's (a note says so).
- multi-head latent attention -> ``--multi-latent-attention`` with the latent ranks and head dims (and the
  latent norms, ``--qk-layernorm``, as DeepSeek has them).
- ZeRO-1 -> ``--use-distributed-optimizer`` (optimizer state and fp32 master weights sharded over the data x
  context parallel ranks); ZeRO-0 -> Megatron's DDP. ZeRO-2/3 are refused (Megatron-FSDP is another engine).
- checkpointing ``full`` -> ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``
  (every layer's input kept, the layer recomputed); ``selective`` -> ``--recompute-granularity selective``
  (Megatron's core-attention recompute, the stack's ``selective_policy``); ``none`` -> no flag.
- the overlaps the megatron-core stack prices: ``--tp-comm-overlap`` (TP communication inside the GEMMs, with
  sequence parallelism) and ``--overlap-moe-expert-parallel-comm`` (MoE all-to-alls behind another micro-batch,
  under the conditions Megatron-Core asserts: ep > 1, no full recompute, two micro-batches, virtual stages when
  pp > 1; :func:`sp_plan.cost_models.strategies.overlap.a2a_overlap_blocker` prices exactly those).
- optimizer offload -> ``--optimizer-cpu-offload --optimizer-offload-fraction 1.0`` (Megatron's hybrid device
  optimizer, which needs ``--use-precision-aware-optimizer``).
- fused cross-entropy, when the plan was priced with it (the stack file's or the plan's ``--assume``
  ``cross_entropy_implementation``): ``megatron_fused`` -> ``--cross-entropy-loss-fusion
  --cross-entropy-fusion-impl native`` (core/fusions/fused_cross_entropy.py), ``te_fused`` -> ``...
  --cross-entropy-fusion-impl te`` (Transformer Engine's parallel_cross_entropy; ModelParallelConfig
  ``cross_entropy_loss_fusion`` / ``cross_entropy_fusion_impl`` at core_v0.16.1); Megatron's unfused
  vocab-parallel loss (``megatron``) is its default and writes nothing.

Plans Megatron cannot run are refused with the reason and what to do (:func:`megatron_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.pipeline import first_even_last_split, head_chunks, head_layer_equivalents, stage_layers
from sp_plan.cost_models.stack import load_stack, prior_stack, shipped_stack_name
from sp_plan.cost_models.strategies.overlap import a2a_overlap_blocker, tp_overlap_blocker
from sp_plan.cost_models.train_spec import TrainSpec

from .errors import PlannerError
from .export_result import Export, comment_text, shell_word
from .plan import Plan

#: The stack profile Megatron-LM runs (``--stack megatron``): the plan is re-checked under it.
MEGATRON_STACK = "megatron-core"
#: The training script the arguments are for (in the Megatron-LM repository root).
PRETRAIN_SCRIPT = "pretrain_gpt.py"
#: Rendezvous port of the generated multi-node launch line.
MASTER_PORT = 29500
#: Transformer Engine attention backends by the plan's attention kernel: the stack runs TE's cuDNN fused
#: attention ('fused'); a materialized-attention plan runs Megatron's unfused (softmax-saving) core attention.
ATTENTION_BACKEND = {"flash": "fused", "materialized": "unfused"}
#: Megatron-LM's cross-entropy flags by the loss the plan was priced with (ModelParallelConfig
#: cross_entropy_loss_fusion / cross_entropy_fusion_impl, core_v0.16.1 model_parallel_config.py:241-249; flags
#: generated by arguments.py's ArgumentGroupFactory(TransformerConfig)). 'megatron' is Megatron's default.
CROSS_ENTROPY_ARGS = {
    "megatron": (),
    "megatron_fused": ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"),
    "te_fused": ("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"),
}
_DTYPE_FLAG = {"bf16": ("--bf16",), "fp16": ("--fp16",), "fp32": ()}
_NORM = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
_POSITION = {"rope": "rope", "learned": "learned_absolute"}
REPLAN = "re-plan with --stack megatron (it searches only what Megatron runs)"
#: ModelSpec fields the arguments express (name and published_params describe, they configure nothing). A
#: field outside this set with a non-default value (a later kind of model: experts, latent attention,
#: sliding windows) is refused rather than exported as the dense model it is not.
MAPPED_MODEL_FIELDS = frozenset({
    "name", "published_params", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
    "ffn_hidden_size", "vocab_size", "tied_embeddings", "activation", "norm", "position_embedding",
    "max_position_embeddings", "qkv_bias", "attn_out_bias", "mlp_bias", "qk_norm", "attention_dropout",
    "hidden_dropout", "published_active_params", "moe", "mla",
})
#: Layout degrees the arguments express; any other degree above 1 is refused (``ep`` is mapped too).
MAPPED_DEGREES = frozenset({"dp_replicate", "dp_shard", "tp", "ulysses", "ring", "pp"})


@dataclass(frozen=True)
class MegatronArguments:
    """The argument set of one plan: ``model_args`` and ``parallel_args`` come from the plan; ``data_args``
    are a stand-in (synthetic data and a tokenizer of the planned vocabulary) for the user's own."""

    model_args: tuple[str, ...]
    parallel_args: tuple[str, ...]
    data_args: tuple[str, ...]
    launcher: tuple[str, ...]
    #: Environment the launch needs (name, value).
    env: tuple[tuple[str, str], ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        """Everything ``pretrain_gpt.py`` is given, in order."""
        return self.model_args + self.parallel_args + self.data_args

    @property
    def command(self) -> str:
        """The launch line, shell-quoted (``$NODE_RANK``/``$MASTER_ADDR`` stay for the shell to expand)."""
        env = [f"{name}={shell_word(value, 'environment value')}" for name, value in self.env]
        return " ".join([*env, *(_quote(a) for a in (*self.launcher, PRETRAIN_SCRIPT, *self.argv))])

    def script(self, header: list[str]) -> str:
        """A bash script: one ``--flag value`` per line in arrays, then the launch line that expands them. Every
        value is one quoted word and the header lines are comments with line breaks escaped, so no plan text
        (a model name from a file name or a plan YAML) can become a command."""
        lines = ["#!/usr/bin/env bash", *(f"# {comment_text(h)}" for h in header), "set -euo pipefail", ""]
        lines += [f"export {name}={shell_word(value, 'environment value')}" for name, value in self.env]
        lines += [""] if self.env else []
        for name, args in (("MODEL_ARGS", self.model_args), ("PARALLEL_ARGS", self.parallel_args),
                           ("DATA_ARGS", self.data_args)):
            lines.append(f"{name}=(")
            lines += [f"  {line}" for line in _flag_lines(args)]
            lines += [")", ""]
        launch = " ".join(_quote(a) for a in self.launcher)
        lines.append(f'{launch} {PRETRAIN_SCRIPT} "${{MODEL_ARGS[@]}}" "${{PARALLEL_ARGS[@]}}" "${{DATA_ARGS[@]}}"')
        return "\n".join(lines)


#: The only launcher words left unquoted, for the shell to expand on each node (exact strings, never plan text).
_SHELL_EXPANDED = frozenset({"--node-rank=$NODE_RANK", "--master-addr=$MASTER_ADDR"})


def _quote(arg: str) -> str:
    return arg if arg in _SHELL_EXPANDED else shell_word(arg, "Megatron-LM argument")


def _flag_lines(args: tuple[str, ...]) -> list[str]:
    """``--flag value ...`` grouped one flag per line, shell-quoted."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return [" ".join(shell_word(a, "Megatron-LM argument") for a in line) for line in lines]


# ----- what Megatron cannot run ---------------------------------------------------------------------


def megatron_refusal(plan: Plan) -> str | None:
    """Why Megatron-LM cannot run ``plan`` as planned (with what to do instead), or None."""
    return (_training_refusal(plan.train) or _model_refusal(plan.model)
            or _layout_refusal(plan.model, plan.train, plan.layout))


def _training_refusal(train: TrainSpec) -> str | None:
    if train.mode != "train":
        return (f"train.mode={train.mode}: pretrain_gpt.py trains; re-plan with --mode train to train, or give the "
                "layout to your inference engine (no launcher here runs prefill)")
    if train.zero_stage >= 2:
        return (f"train.zero_stage={train.zero_stage}: Megatron's distributed optimizer is ZeRO-1 (optimizer state "
                f"and master weights sharded; gradients and parameters are not); ZeRO-2/3 is Megatron-FSDP, not "
                f"exported; {REPLAN}")
    if train.optimizer != "adamw":
        return (f"train.optimizer={train.optimizer}: Megatron keeps fp32 master weights and moments (adamw); "
                f"re-plan with --optimizer adamw --stack megatron")
    for option, what in (("offload_params", "parameter offload"), ("tiled_mlp", "a tiled MLP"),
                         ("tiled_loss", "a tiled loss"),
                         ("offload_checkpoints", "checkpoint offload (its --cpu-offloading refuses recompute)")):
        if getattr(train, option):
            return f"train.{option}: Megatron-Core has no {what}; {REPLAN}"
    if train.document_length is not None:
        return ("train.document_length: packed documents need Megatron's packed-sequence (THD) data path, which "
                "pretrain_gpt.py's arguments do not set up; plan without --document-length")
    return None


def _model_refusal(model: ModelSpec) -> str | None:
    for name, spec in type(model).model_fields.items():
        if name not in MAPPED_MODEL_FIELDS and getattr(model, name) != spec.get_default(call_default_factory=True):
            return (f"{model.name}: model field {name}={getattr(model, name)!r} has no mapping in this export "
                    "(it writes dense decoder-only GPT arguments); export --to torchrun")
    if model.position_embedding not in _POSITION:
        return f"{model.name}: Megatron's GPT has no {model.position_embedding} position embedding (rope or learned)"
    if model.mla is not None and model.qk_norm:
        return (f"{model.name}: Megatron's latent attention normalises the latents (--qk-layernorm), not per-head "
                "queries and keys as well; export --to torchrun")
    biases = (model.qkv_bias, model.attn_out_bias, model.mlp_bias)
    if model.moe is not None and any(biases):
        return (f"{model.name}: Megatron's experts have no biases with tensor-parallel experts (its rule: bias "
                "in MoE only with expert tensor parallelism 1); export --to torchrun")
    if any(biases) and not all(biases) and biases != (True, False, False):
        return (f"{model.name}: Megatron adds biases to every linear or (with --disable-bias-linear) to none but "
                "optionally Q/K/V (--add-qkv-bias); this model's bias pattern is neither")
    return None


def _layout_refusal(model: ModelSpec, train: TrainSpec, layout: Layout) -> str | None:
    unmapped = {dim: d for dim, d in layout.degrees().items() if dim not in MAPPED_DEGREES and d > 1}
    if unmapped:
        return f"degrees {unmapped} have no mapping in this export"
    pipeline = _pipeline_refusal(model, train, layout)
    if pipeline:
        return pipeline
    tp, ulysses, cp = layout.tp, layout.ulysses, layout.ulysses * layout.ring
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        return (f"tp={tp} neither divides nor is a multiple of the {model.num_kv_heads} KV heads "
                f"(Megatron's num_query_groups rule); {REPLAN}")
    if (model.num_heads // tp) % ulysses:
        return f"ulysses={ulysses} does not divide the {model.num_heads // tp} query heads per TP rank; {REPLAN}"
    # The head and chunk rules the megatron-core stack's search applies (its file's `search` section).
    stack_rule = prior_stack(MEGATRON_STACK).search.refusal(model, layout, train.seq_len)
    if stack_rule:
        return f"{stack_rule}; {REPLAN}"
    if tp > 1 and train.tp_sequence_parallel and (train.seq_len // cp) % tp:
        return (f"seq_len / cp = {train.seq_len // cp} tokens per context-parallel rank do not divide by tp={tp} "
                "(Megatron sequence parallelism); pad the sequence length")
    if layout.dp_replicate > 1 and train.zero_stage == 0:
        return (f"dp_replicate={layout.dp_replicate} without ZeRO: Megatron's DDP has no replicate/shard split "
                f"(it is --num-distributed-optimizer-instances of the distributed optimizer); {REPLAN}")
    return None


# ----- the arguments -----------------------------------------------------------------------------------


def _model_args(model: ModelSpec, train: TrainSpec) -> list[str]:
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(model.ffn_hidden_size), "--num-attention-heads", str(model.num_heads)]
    if model.mla is not None:
        args += _latent_attention_args(model)
    else:
        if model.num_kv_heads != model.num_heads:
            args += ["--group-query-attention", "--num-query-groups", str(model.num_kv_heads)]
        args += ["--kv-channels", str(model.head_dim)]
    if model.moe is not None:
        args += _expert_args(model)
    args += ["--seq-length", str(train.seq_len),
             "--max-position-embeddings", str(max(train.seq_len, model.max_position_embeddings)),
             "--position-embedding-type", _POSITION[model.position_embedding],
             "--normalization", _NORM[model.norm]]
    if model.activation == "swiglu":
        args.append("--swiglu")  # Megatron's default MLP activation is GeLU
    if not model.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.mlp_bias:
        args.append("--disable-bias-linear")
        if model.qkv_bias:
            args.append("--add-qkv-bias")
    if model.qk_norm:
        args.append("--qk-layernorm")
    # Megatron's defaults are 0.1; the plan's model says what it trains with.
    args += ["--attention-dropout", str(model.attention_dropout), "--hidden-dropout", str(model.hidden_dropout)]
    return args


def _latent_attention_args(model: ModelSpec) -> list[str]:
    """MLA: Megatron's ``--qk-head-dim`` is the content (no-RoPE) part, ``--qk-pos-emb-head-dim`` the decoupled
    RoPE part; no ``--q-lora-rank`` means a full query projection (DeepSeek-V2-Lite)."""
    mla = model.mla
    assert mla is not None
    args = ["--multi-latent-attention", "--qk-layernorm"]
    if mla.q_lora_rank is not None:
        args += ["--q-lora-rank", str(mla.q_lora_rank)]
    return args + ["--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim", str(mla.qk_nope_head_dim),
                   "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim), "--v-head-dim", str(mla.v_head_dim)]


def moe_layer_pattern(num_layers: int, dense_layers: tuple[int, ...]) -> str:
    """``--moe-layer-freq`` for dense layers among MoE ones: Megatron's list expression (1 = MoE layer) as runs,
    e.g. ``[0]*3+[1]*58`` for DeepSeek-V3's three dense layers first."""
    flags = [0 if i in dense_layers else 1 for i in range(num_layers)]
    runs: list[list[int]] = []
    for flag in flags:
        if runs and runs[-1][0] == flag:
            runs[-1][1] += 1
        else:
            runs.append([flag, 1])
    return "+".join(f"[{flag}]*{count}" for flag, count in runs)


def _expert_args(model: ModelSpec) -> list[str]:
    moe = model.moe
    assert moe is not None
    args = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k),
            "--moe-ffn-hidden-size", str(moe.expert_ffn_hidden_size)]
    if moe.shared_width:
        args += ["--moe-shared-expert-intermediate-size", str(moe.shared_width)]
    if moe.dense_layers:
        args += ["--moe-layer-freq", moe_layer_pattern(model.num_layers, moe.dense_layers)]
    if moe.capacity_factor is not None:  # the planner prices every expert padded to its capacity
        args += ["--moe-expert-capacity-factor", str(moe.capacity_factor), "--moe-pad-expert-input-to-capacity"]
    return args + ["--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"]


def _recompute_args(train: TrainSpec) -> list[str]:
    if train.checkpointing == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if train.checkpointing == "selective":
        return ["--recompute-granularity", "selective"]
    return []


def _context_parallel_args(layout: Layout) -> list[str]:
    cp = layout.ulysses * layout.ring
    if cp == 1:
        return []
    args = ["--context-parallel-size", str(cp)]
    if layout.ulysses > 1 and layout.ring > 1:
        return args + ["--cp-comm-type", "a2a+p2p",
                       "--hierarchical-context-parallel-sizes", str(layout.ulysses), str(layout.ring)]
    return args + ["--cp-comm-type", "a2a" if layout.ulysses > 1 else "p2p"]


def _pipeline_refusal(model: ModelSpec, train: TrainSpec, layout: Layout) -> str | None:
    """What of the plan's pipeline Megatron-LM cannot run: the zero-bubble schedule, and stage splits other than
    first / evenly split middle / last (with virtual stages, each a multiple of the chunks per stage)."""
    if layout.pp == 1:
        return None
    if train.pipeline_schedule == "zero_bubble":
        return ("Megatron-LM's pretrain_gpt.py runs 1F1B and interleaved 1F1B, not the zero-bubble schedule; "
                "re-plan with --schedule interleaved_1f1b or --schedule 1f1b (or --stack megatron)")
    split, v = stage_layers(model, train, layout), train.virtual_stages
    middle = set(split[1:-1])
    if len(middle) > 1:
        hint = first_even_last_split(model.num_layers, layout.pp, v, head_layer_equivalents(model, train, layout))
        return (f"stage split {list(split)}: Megatron splits the stages between the first and the last evenly; "
                + (f"re-plan with --stage-layers {','.join(map(str, hint))}" if hint else "pin --stage-layers"))
    if v > 1 and any(n % v for n in split) and head_chunks(split, v) is None:
        return (f"stage split {list(split)} with {v} virtual stages: Megatron gives every model chunk of a stage "
                f"the same layers, so each stage's layers must divide by {v}, or all stages hold the same with "
                "the embedding and the loss counted as a layer each; pin --stage-layers")
    return None


def _pipeline_args(plan: Plan) -> list[str]:
    layout, train = plan.layout, plan.train
    args = ["--pipeline-model-parallel-size", str(layout.pp)]
    if layout.pp == 1:
        return args
    if train.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(train.virtual_stages)]
    split = stage_layers(plan.model, train, layout)
    even = plan.model.num_layers // layout.pp
    counted = head_chunks(split, train.virtual_stages)
    if counted is not None:
        embedding, loss = counted
        args += ["--account-for-embedding-in-pipeline-split"] * embedding
        args += ["--account-for-loss-in-pipeline-split"] * loss
    elif any(n != even for n in split):
        args += ["--decoder-first-pipeline-num-layers", str(split[0]),
                 "--decoder-last-pipeline-num-layers", str(split[-1])]
    return args


def _overlap_args(plan: Plan) -> list[str]:
    """The overlaps the megatron-core stack prices (its stack file's time section, as Megatron-Bridge's
    performance recipes run them): TP communication inside the GEMMs (Transformer Engine userbuffers), and the
    MoE dispatch/combine all-to-alls behind another micro-batch (the combined 1F1B schedule)."""
    stack = prior_stack(MEGATRON_STACK).time
    args = []
    if tp_overlap_blocker(stack, plan.train, plan.layout) is None:
        args.append("--tp-comm-overlap")
    if a2a_overlap_blocker(stack, plan.model, plan.train, plan.layout) is None:
        args.append("--overlap-moe-expert-parallel-comm")
    return args


def is_megatron_stack(ref: str) -> bool:
    """Whether a plan's stack is Megatron's: the shipped megatron-core (by any alias) or a stack file that names
    itself so (an edited copy of megatron-core.yaml); a file that cannot be read here is not."""
    if shipped_stack_name(ref) is not None:
        return shipped_stack_name(ref) == MEGATRON_STACK
    try:
        profile = load_stack(ref)
    except CostModelError:
        return False
    return profile.name == MEGATRON_STACK or profile.name in prior_stack(MEGATRON_STACK).aliases


def cross_entropy_implementation(plan: Plan, stack: str | None = None) -> str:
    """The loss the plan is priced with under Megatron: the plan's ``--assume`` override, else ``stack``'s (the
    export's ``--stack``), else the plan's own stack file when it is Megatron's, else megatron-core's."""
    if "cross_entropy_implementation" in plan.assume:
        return plan.assume["cross_entropy_implementation"]
    ref = stack or (plan.stack if is_megatron_stack(plan.stack) else MEGATRON_STACK)
    return load_stack(ref).memory.cross_entropy_implementation


def _parallel_args(plan: Plan, cross_entropy: str) -> list[str]:
    layout, train = plan.layout, plan.train
    args = ["--tensor-model-parallel-size", str(layout.tp), *_pipeline_args(plan),
            *_context_parallel_args(layout), "--expert-model-parallel-size", str(layout.ep)]
    if layout.tp > 1 and train.tp_sequence_parallel:
        args.append("--sequence-parallel")
    args += _overlap_args(plan)
    if train.zero_stage == 1:
        args += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
        if layout.dp_replicate > 1:
            args += ["--num-distributed-optimizer-instances", str(layout.dp_replicate)]
    if train.offload_optimizer:
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0", "--use-precision-aware-optimizer"]
    args += _recompute_args(train)
    args += ["--micro-batch-size", str(train.micro_batch),
             "--global-batch-size", str(train.micro_batch * train.grad_accum * layout.dp)]
    args += [*_DTYPE_FLAG[train.dtype], "--attention-backend", ATTENTION_BACKEND[train.attention_kernel]]
    args += CROSS_ENTROPY_ARGS.get(cross_entropy, ())
    if train.fp8_linears:
        args += ["--fp8-format", "hybrid"]
    return args


def _data_args(model: ModelSpec) -> list[str]:
    """Synthetic data and a tokenizer whose vocabulary is the plan's: Megatron's NullTokenizer adds one
    end-of-document token to ``--vocab-size``; ``--make-vocab-size-divisible-by 1`` pads only to a multiple
    of tp, as the planner's vocab-parallel split assumes (Megatron's default pads to 128 x tp)."""
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size - 1),
            "--make-vocab-size-divisible-by", "1"]


def _environment(layout: Layout) -> list[tuple[str, str]]:
    """validate_args requires CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism before
    Blackwell (so that communication kernels are scheduled ahead of the GEMMs they overlap)."""
    return [("CUDA_DEVICE_MAX_CONNECTIONS", "1")] if layout.tp > 1 or layout.ulysses * layout.ring > 1 else []


def _launcher(plan: Plan) -> list[str]:
    hw = plan.hardware
    procs = min(hw.gpus_per_node, hw.num_gpus)
    if hw.num_nodes == 1:
        return ["torchrun", "--standalone", f"--nproc-per-node={procs}"]
    return ["torchrun", f"--nnodes={hw.num_nodes}", f"--nproc-per-node={procs}", "--node-rank=$NODE_RANK",
            "--master-addr=$MASTER_ADDR", f"--master-port={MASTER_PORT}"]


def megatron_arguments(plan: Plan, stack: str | None = None) -> MegatronArguments:
    """The argument set of a plan Megatron can run (refused with the reason otherwise); ``stack``: the stack the
    export checks the plan under (its loss decides the cross-entropy flags; default: see
    :func:`cross_entropy_implementation`)."""
    reason = megatron_refusal(plan)
    if reason:
        raise PlannerError(f"Megatron-LM cannot run this plan ({plan.layout.describe()}): {reason}")
    cross_entropy = cross_entropy_implementation(plan, stack)
    return MegatronArguments(tuple(_model_args(plan.model, plan.train)), tuple(_parallel_args(plan, cross_entropy)),
                             tuple(_data_args(plan.model)), tuple(_launcher(plan)), tuple(_environment(plan.layout)))


def _notes(plan: Plan, cross_entropy: str) -> list[str]:
    notes = [
        "DATA_ARGS train on synthetic tokens (--mock-data) with a tokenizer of the planned vocabulary; for real "
        "data give --data-path and your tokenizer (e.g. --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
        "PATH), and add --train-iters, --lr and the schedule",
        "--rotary-base: the plan's model does not record its RoPE base (Megatron's default is 10000; Llama 3 uses "
        "500000): add it for your model",
        "run from the Megatron-LM repository root (pretrain_gpt.py) with Transformer Engine installed",
    ]
    if plan.hardware.num_nodes > 1:
        notes.append("run the same command on every node with NODE_RANK=0..N-1 and MASTER_ADDR=<first node>")
    if plan.model.moe is not None:
        notes.append("the router's score function, group-limited routing, expert bias and auxiliary-loss type and "
                     "coefficient are the model recipe's (e.g. --moe-router-score-function sigmoid "
                     "--moe-router-enable-expert-bias for DeepSeek-V3): add them; the plan fixes only the expert "
                     "shapes, routing top-k, capacity and parallelism")
    if plan.model.mla is not None:
        notes.append("latent attention: add the model's RoPE scaling (--rotary-scaling-factor, --mscale, "
                     "--mscale-all-dim for DeepSeek's YaRN); the plan does not record it")
    if plan.train.compiled:
        notes.append("train.compiled: Megatron does not torch.compile its layers (it runs fused TE/JIT kernels)")
    if cross_entropy == "te_fused":
        notes.append("--cross-entropy-fusion-impl te runs on Megatron-LM core_v0.16.x; later Megatron-LM refuses it "
                     "(validate_args: 'disabled due to stability issues', NVIDIA/Megatron-LM#5115): there, re-plan "
                     "with --assume cross_entropy_implementation=megatron_fused and export --cross-entropy-fusion-impl "
                     "native")
    elif cross_entropy not in CROSS_ENTROPY_ARGS:
        notes.append(f"the plan was priced with the {cross_entropy!r} loss, which Megatron does not run: the export "
                     "keeps Megatron's vocab-parallel cross-entropy (re-check with --stack megatron)")
    if plan.layout.tp > 1 and not plan.train.tp_sequence_parallel:
        notes.append("the plan has TP without sequence parallelism: --sequence-parallel is left off as planned")
    return notes


def to_megatron(plan: Plan, stack: str | None = None) -> Export:
    """The plan as a bash script of Megatron-LM ``pretrain_gpt.py`` arguments plus its torchrun launch line
    (``content``), and the same as data (``data``, for ``--json``); ``stack`` as :func:`megatron_arguments`."""
    args = megatron_arguments(plan, stack)
    cross_entropy = cross_entropy_implementation(plan, stack)
    header = [f"Megatron-LM {PRETRAIN_SCRIPT} arguments for {plan.model.name} at {plan.train.seq_len} tokens on "
              f"{plan.hardware.num_gpus} x {plan.hardware.gpu} ({plan.layout.describe()}); written by "
              "`sp-plan export --to megatron`"]
    notes = _notes(plan, cross_entropy)
    data = {"target": "megatron", "script": PRETRAIN_SCRIPT, "stack": MEGATRON_STACK,
            "model_args": list(args.model_args), "parallel_args": list(args.parallel_args),
            "data_args": list(args.data_args), "argv": list(args.argv), "env": dict(args.env),
            "command": args.command, "notes": notes}
    return Export(args.script(header), notes, data)


__all__ = ["ATTENTION_BACKEND", "CROSS_ENTROPY_ARGS", "MEGATRON_STACK", "MegatronArguments",
           "cross_entropy_implementation", "is_megatron_stack", "megatron_arguments", "megatron_refusal",
           "moe_layer_pattern", "to_megatron"]
