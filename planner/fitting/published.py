"""The published GPU measurements (``cost_models/data/calibration/published.yaml``) as measured runs.

The YAML keeps each source's figures as published; this module states, per source, what the figures
leave implicit and the model needs: the machine (a topology preset), the software stack, the options a
named recipe implies ("alst" = ZeRO-3 + optimizer offload + checkpointing + tiled MLP + checkpoint
offload + fused loss), the model shapes for models named only by their size, and the FLOP convention of
TFLOP/s figures. Everything assumed is stated in the run's ``assumed`` text, which the accuracy report
prints. Pipelined entries run with their schedule, micro-batches and (where the source's code fixes it) its
layer split; mixture-of-experts entries with their expert-parallel degree and the source's routing balance.
Entries the model cannot represent are returned as skipped, with why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from sp_plan.cost_models import data as shipped_data
from sp_plan.cost_models import degrees as registry
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec, get_model_preset
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.cost_models.yaml_io import safe_load

from .published_parallel import (
    expert_degree,
    global_batch_accumulation,
    pipeline_train,
    with_load_imbalance,
)
from .runs import METRICS, MeasuredRun


@dataclass(frozen=True)
class SourceSetup:
    """What a source's runs share: machine, stack, defaults for options the entries do not repeat."""

    topology: str
    stack: str
    defaults: dict[str, Any]
    memory_overrides: dict[str, Any]
    note: str
    time_overrides: dict[str, Any] = field(default_factory=dict)
    #: MoE routing balance the source states (busiest expert / mean); None: the model preset's default.
    moe_load_imbalance: float | None = None


#: Per source: the machine, the stack and the defaults its text implies (see the YAML's `sources:`).
SOURCES: dict[str, SourceSetup] = {
    "arctic-recipes": SourceSetup(
        "aws-p5", "hf-deepspeed",
        {"zero_stage": 3, "offload_optimizer": True, "checkpointing": "full", "tiled_loss": True, "micro_batch": 1},
        {}, "p5.48xlarge nodes (8 x H100 80GB, EFA); ALST recipe options",
    ),
    "torchtitan-h100": SourceSetup(
        "grand-teton-h100", "torchtitan", {"zero_stage": 3}, {},
        "Grand Teton H100 96GB; FSDP2 reshard-after-forward (ZeRO-3)",
    ),
    "torchtitan-405b-h100": SourceSetup(
        "grand-teton-h100", "torchtitan", {"zero_stage": 3}, {},
        "Grand Teton H100 96GB, 512 GPUs; FSDP2 without resharding after forward under PP (ZeRO-2), torchtitan's "
        "generated layer split and its default micro-batch count (pp degree) at the benchmarked commit; AsyncTP "
        "(TP communication pipelined with its GEMMs) as the torchtitan stack file's tp_comm_overlap: async_tp (the "
        "runs compile)",
    ),
    "llm-foundry-h100": SourceSetup(
        "dgx-h100", "torchtitan", {"zero_stage": 3}, {},
        "8 x H100 80GB; llm-foundry v0.3.0 + Composer 0.16 on torch 2.1.0 (submit_benchmarks.py at b2a43a1, "
        "2023-10-19): FSDP1 FULL_SHARD (ZeRO-3), mixed precision DEFAULT (bf16 parameters; gradients reduced in bf16 "
        "under Composer 0.16.3, in fp32 from 0.16.4 of 2023-10-11: which release ran is not stated, priced fp32 as "
        "sp-plan's FSDP reduces), full non-reentrant activation checkpointing, no activation CPU offload, gradient "
        "accumulation as the table's GradAccum column; the benchmark's MPT-7B (learned positions, biases, vocab "
        "50368; no ALiBi); its attention is attn_impl triton (flash_attn_triton.py on triton-pre-mlir), a kernel "
        "with no published H100 kernel-level figures: priced as FlashAttention-2, the nearest kernel the kernel data "
        "pin; Composer + FSDP1 priced with the torchtitan (FSDP) stack's overheads, the nearest shipped",
        time_overrides={"attention_kernel": "fa2"},
    ),
    "fpdt": SourceSetup(
        "dgx-a100", "hf-deepspeed", {"zero_stage": 3, "checkpointing": "none"},
        # Megatron-DeepSpeed, not HF + Liger: its own RoPE (eager), no Liger kernels; Megatron's
        # CheckpointFunction is reentrant like the stack's; fused (apex) norms.
        {"norm_implementation": "fused", "rope_implementation": "eager", "flash_varlen_pad_rows": 0,
         "alltoall_head_major_copy": False, "cross_entropy_implementation": "megatron"},
        "GPU type not stated (80 GB implied): A100 80GB assumed; Megatron-DeepSpeed GPT code (fused norms, eager "
        "RoPE, DeepSpeed's DistributedAttention all-to-alls, Megatron's in-place vocab-parallel cross-entropy)",
    ),
    "ring-attention": SourceSetup(
        "dgx-a100", "sp-plan", {"zero_stage": 3, "dtype": "fp32"}, {},
        "A100 80GB; JAX FSDP + ring attention in fp32: no shipped stack is JAX, sp-plan's assumptions used",
    ),
    "factory-360": SourceSetup(
        "dgx-a800", "hf-deepspeed", {"micro_batch": 1},
        # No Liger: HF's eager RMSNorm, SwiGLU and RoPE; ring-flash-attn's zigzag ring calls the dense
        # flash kernel (no varlen padding) and no Ulysses all-to-all.
        {"norm_implementation": "eager", "mlp_implementation": "eager", "rope_implementation": "eager",
         "flash_varlen_pad_rows": 0, "hf_logits_fp32_in_output": True},
        "A800 80GB; HF + DeepSpeed ZeRO-3 + ring-flash-attn, no Liger (eager RMSNorm, SwiGLU, RoPE); HF "
        "gradient checkpointing (reentrant), DeepSpeed's default buckets; fp32 logits in the model output (its "
        "README lists 'commenting logits = logits.float()' among the tricks NOT used for these lengths); labels "
        "pre-shifted before the zigzag split (no shift copy); lengths are its 'coarse-grained' benchmark",
    ),
    "usp-attention": SourceSetup(
        "dgx-a100", "sp-plan", {"mode": "prefill", "dtype": "bf16"}, {},
        "attention forward only, batch 1, yunchang's USP with zigzag ring (flash-attn 2); its ring merge is "
        "ring-flash-attn's TorchScript-fused _update_out_and_lse (~12 B per element)",
        {"ring_merge_bytes_per_element": 12.0, "alltoall_copy_passes": 2.0},
    ),
    "megatron-recompute": SourceSetup(
        "dgx-a100", "sp-plan", {"micro_batch": 4, "attention_kernel": "materialized", "zero_stage": 0,
                                "dtype": "bf16"},
        {"selective_policy": "attention_core_recompute", "tp_saves_gathered_input": False},
        "DGX A100 (Selene); micro-batch 4 (the paper's 22B configuration); Megatron's fused softmax, no flash; "
        "Megatron-LM's column-parallel backward as at the paper's time (35a3fa8b7c, 2022-05-13, "
        "mpu/layers.py LinearWithGradAccumulationAndAsyncAllreduce, on unless --no-async-tensor-model-parallel-"
        "allreduce): the input-gradient all-reduce runs beside the weight-gradient GEMM; with sequence "
        "parallelism the layer input is saved as its shard and gathered again in backward (the paper's 34sbh/t "
        "activation memory), beside the input-gradient GEMM",
        time_overrides={"tp_async_dgrad": True},
    ),
    "nemo-long-sequence": SourceSetup(
        "dgx-h100", "megatron-core",
        {"zero_stage": 1, "checkpointing": "none", "micro_batch": 1, "fp8_linears": True,
         "tp_sequence_parallel": True},
        {},
        "DGX-B200 (LLAMA3-8B) / DGX-H100 (LLAMA2-7B); Megatron-Core + Transformer Engine: FP8 linears, TP with "
        "sequence parallelism, CP = ring (P2P, load-balanced), distributed optimizer (ZeRO-1 over DP x CP), "
        "micro-batch 1 and gradient accumulation to the 4M-token global batch, no activation recompute (not "
        "stated; Megatron's default); TFLOP/s in NeMo's llama formula; TP communication not overlapped (NeMo's "
        "llama3_8b recipe family sets MegatronCommOverlapCallback(tp_comm_overlap=False))",
        time_overrides={"tp_comm_overlap": "none"},
    ),
    "llama3-paper": SourceSetup(
        "dgx-h100@roce-400:8", "sp-plan",
        {"zero_stage": 2, "checkpointing": "selective", "micro_batch": 1, "pipeline_schedule": "interleaved_1f1b",
         "virtual_stages": 8},
        {},
        "Meta's 24K-GPU H100 clusters (8 x 400 Gb/s RoCE per node); their own 4D-parallel stack, priced with "
        "sp-plan's stack: FSDP sharding optimizer states and gradients but not the weights (ZeRO-2), interleaved "
        "1F1B (the paper's schedule) with 8 chunks per stage, one layer fewer on the first and the last stage: "
        "section 3.3.2's \"the first model chunk on the first stage has only the embedding, and the last model "
        "chunk on the last stage has only output projection and loss calculation\" with one layer fewer at each "
        "end leaves one layer per chunk (126 layers, the embedding and the loss in 16 x 8 chunks), "
        "16 micro-batches of one 128K sequence per "
        "data-parallel rank (the 16M-token batch over dp 8), selective recompute assumed (not stated); their context "
        "parallelism all-gathers K/V where sp-plan prices a ring",
    ),
    "megatron-bridge-perf": SourceSetup(
        "dgx-h100", "megatron-core",
        {"zero_stage": 1, "checkpointing": "none", "fp8_linears": True, "tp_sequence_parallel": True},
        {},
        "DGX-H100 (FP8 current scaling) / DGX-B200 (MXFP8, priced as the fp8 tensor cores); Megatron-Core + "
        "Transformer Engine performance recipes (Megatron-Bridge v0.4.2 scripts/performance/configs): distributed "
        "optimizer (ZeRO-1 over DP), no activation recompute (the Qwen recipes set it off; DeepSeek-V3's "
        "recomputes its MLA up-projections and MLPs, not priced), TP with sequence parallelism, interleaved 1F1B "
        "where VP is given, the planner's balanced layer split unless the recipe fixes a pipeline layout; MoE: "
        "routing force-balanced (load imbalance 1.0), dropless, expert parallelism over the data-parallel ranks",
        moe_load_imbalance=1.0,
    ),
    "megatron-bridge-archive": SourceSetup(
        "dgx-h100", "megatron-core",
        {"zero_stage": 1, "checkpointing": "none", "fp8_linears": True, "tp_sequence_parallel": True},
        {},
        "DGX-H100 (FP8 current scaling) / DGX-B200 (FP8 current scaling or MXFP8, both priced as the fp8 tensor "
        "cores); Megatron-Core + Transformer Engine performance recipes of each row's release (Megatron-Bridge "
        "v0.1.0rc3 perf_matrix YAMLs for 25.09, v0.2.0-v0.5.0 scripts/performance/configs after): distributed "
        "optimizer (ZeRO-1 over DP) unless the table's FSDP column is set (Megatron-FSDP optim_grads_params: "
        "ZeRO-3), no activation recompute, TP with sequence parallelism and TE userbuffers TP overlap (the 70B and "
        "405B recipes), interleaved 1F1B where VP is given, the planner's balanced layer split",
    ),
    "nemo-perf-summary": SourceSetup(
        "dgx-b200", "megatron-core",
        {"zero_stage": 1, "checkpointing": "none", "fp8_linears": True, "tp_sequence_parallel": True},
        {},
        "DGX-B200; NeMo 25.02 container, NeMo 2.0 performance recipes (NeMo v2.2.0 scripts/llm/performance): "
        "Megatron-Core + Transformer Engine, FP8 delayed scaling (priced as the fp8 tensor cores), distributed "
        "optimizer (ZeRO-1 over DP), no activation recompute, TP with sequence parallelism and TE userbuffers TP "
        "overlap (the B200 70B and 405B configs), interleaved 1F1B where VP is given, the planner's balanced layer "
        "split; no CUDA graphs (the per-layer host cost is priced either way)",
    ),
    "ulysses-paper-figures": SourceSetup(
        "dgx-a100", "hf-deepspeed", {"micro_batch": 1}, {},
        "8 DGX-A100 nodes (IB HDR); Megatron-DeepSpeed GPT; TFLOP/s by Megatron-DeepSpeed's formula",
    ),
    "hf-ulysses-blog": SourceSetup(
        "dgx-h100", "hf-deepspeed",
        {"zero_stage": 3, "offload_optimizer": True, "checkpointing": "full", "micro_batch": 1, "tiled_loss": False},
        # No Liger: HF's eager RMSNorm (q/k norms too), SwiGLU and RoPE; transformers >= 5 returns bf16 logits
        # and ForCausalLMLoss upcasts them (the stack's 'hf' cross-entropy).
        {"norm_implementation": "eager", "mlp_implementation": "eager", "rope_implementation": "eager"},
        "H100 80GB (machine not named: a DGX H100's NVLink assumed); TRL SFTTrainer + Accelerate + DeepSpeed ZeRO-3 "
        "with CPU Adam, HF gradient checkpointing, flash-attn 2, DeepSpeed Ulysses, no Liger/TiledMLP/checkpoint "
        "offload; one book-length document per sequence (Gutenberg English); the job's tokens/s divided by its GPUs",
    ),
}

#: Job-wide metrics a source publishes, as (per-GPU metric they are compared as, divide by the GPUs).
JOB_TOTAL_METRICS = {"tps_total": "tps_per_gpu"}


def _arctic_entry(entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    notes = []
    if "metric" in entry and entry["model"] == "qwen3-32b" and entry["gpus"] == 32:
        notes.append("the recipe's comment says this figure was measured with PyTorch 2.4; the others with the "
                     "2.8 nightly the README names (allocator, NCCL and c10d stream handling differ)")
    host_bound = (entry["model"] == "llama3.1-70b" and entry["gpus"] >= 16) or (
        entry["model"] == "qwen3-32b" and entry["gpus"] == 8)
    if "metric" not in entry and entry.get("options") == "alst" and host_bound:
        notes.append("host RAM (1.9 TB per node: offloaded checkpoints of every layer + DeepSpeedCPUAdam states, "
                     "~1.6-1.8 TB per node at these lengths by the model's host accounting) bounds this length "
                     "(the 32-GPU 70B recipe: 'at the brink of cpu-oom'); the NV memory the 70B recipes report "
                     "leaves 26-32 GiB of GPU headroom")
    return {}, "; ".join(notes)


def _fpdt_entry(entry: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if "ulysses" in entry and "checkpointing" not in entry:
        # Without activation checkpointing Llama-3-8B at 8K tokens per GPU saves ~44 GB of activations on top of
        # 16 GB of ZeRO states and GBs of logits: more than the 52-59 GB reported. The Ulysses rows are read as
        # Megatron-DeepSpeed's --checkpoint-activations (full) runs.
        return {"checkpointing": "full"}, ("checkpointing not stated for the Ulysses + ZeRO rows; full assumed "
                                           "(without it the reported HBM cannot hold the activations)")
    return {}, ""


#: Per source, what an entry implies beyond the source's defaults: (train options, assumption text).
ENTRY_ASSUMPTIONS = {"arctic-recipes": _arctic_entry, "fpdt": _fpdt_entry}

#: Source model names -> shipped presets.
MODEL_ALIASES = {
    "llama3.1-8b": "llama3-8b",
    "llama3.1-70b": "llama3-70b",
    "llama3.1-405b": "llama3-405b",
    "qwen3-32b": "qwen3-32b",
    "qwen2.5-7b": "qwen2.5-7b",
    "qwen2.5-14b": "qwen2.5-14b",
    "qwen2.5-72b": "qwen2.5-72b",
    "llama2-7b": "llama2-7b",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
    "deepseek-v3": "deepseek-v3",
    "qwen3-4b": "qwen3-4b",
    # Ring Attention's "LLaMA architecture" models: dimensions unpublished; LLaMA-1's are assumed.
    "llama-arch 7B": "llama-7b",
    "llama-arch 13B": "llama-13b",
}


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """A Megatron GPT of the given shape: MHA, 4h GELU FFN, LayerNorm, GPT-2 vocabulary; rotary
    positions assumed (no position table: the sources do not state it and it is <1% of parameters)."""
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, ffn_hidden_size=4 * hidden, vocab_size=50257, activation="gelu",
                     norm="layernorm", position_embedding="rope", qkv_bias=True, attn_out_bias=True, mlp_bias=True)


#: Models the sources describe only by shape.
SHAPED_MODELS: dict[str, ModelSpec] = {
    "gpt 30B dense (64L, d6144, 64 heads)": _gpt("gpt-30b (64L, d6144)", 64, 6144, 64),
    "gpt 22B layer (h6144, a64, s2048, TP8)": _gpt("gpt-22b (48L, d6144)", 48, 6144, 64),
}


def _mpt_benchmark(seq_len: int) -> ModelSpec:
    """MPT-7B as llm-foundry's throughput benchmark built it, not the released checkpoint (ALiBi, no biases):
    v0.3.0's scripts/train/yamls/pretrain/mpt-7b.yaml sets only d_model 4096, 32 heads, 32 layers, expansion 4,
    vocab 50368 and max_seq_len, so MPTConfig's defaults apply (alibi False -> learned positions of max_seq_len,
    no_bias False, LayerNorm with bias, tied embeddings). The table's NumParams column grows by 4096 per token
    of length (6,658,859,008 at 2K, 6,918,905,856 at 64K): the position table, which this spec reproduces."""
    return ModelSpec(name="mpt-7b-benchmark", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                     head_dim=128, ffn_hidden_size=4 * 4096, vocab_size=50368, tied_embeddings=True,
                     activation="gelu", norm="layernorm", position_embedding="learned",
                     max_position_embeddings=seq_len, qkv_bias=True, attn_out_bias=True, mlp_bias=True)


#: Models whose parameters depend on the run's sequence length (a learned position table of max_seq_len).
LENGTH_SHAPED_MODELS = {"mpt-7b (llm-foundry benchmark yaml, max_seq_len positions)": _mpt_benchmark}

#: The USP report's attention benchmark: Llama-3-8B's attention shape, one layer.
USP_ATTENTION_MODEL = ModelSpec(name="llama3-8b attention", num_layers=1, hidden_size=4096, num_heads=32,
                                num_kv_heads=8, head_dim=128, ffn_hidden_size=14336, vocab_size=128256)

#: Why the USP tables are compared by ratios only.
USP_SCALE_NOTE = ("tables compared by ratios between layouts: the report's 128K rows are ~3x slower than its 32K "
                  "rows scaled by attention's quadratic work, so the absolute levels of its tables disagree")

#: Named option bundles of the arctic recipes.
OPTION_BUNDLES: dict[str, dict[str, Any]] = {
    "alst": {"tiled_mlp": True, "offload_checkpoints": True},
    "alst without checkpoint offload": {"tiled_mlp": True},
    "alst + parameter offload": {"tiled_mlp": True, "offload_checkpoints": True, "offload_params": True},
}

#: The machines the Megatron tables name (their `system` column).
SYSTEM_TOPOLOGIES = {"h100": "dgx-h100", "b200": "dgx-b200"}

_OPTION_KEYS = ("zero", "checkpointing", "micro_batch", "dtype", "offload_checkpoints")


@dataclass(frozen=True)
class Skipped:
    id: str
    source: str
    reason: str


@cache
def published_entries() -> dict[str, Any]:
    return safe_load(shipped_data.read_text("calibration", "published"))


def _model(name: str, seq_len: int | None = None) -> ModelSpec:
    if name in LENGTH_SHAPED_MODELS:
        if seq_len is None:
            raise CostModelError(f"published model {name!r} is sized by the run's sequence length; give seq_len")
        return LENGTH_SHAPED_MODELS[name](seq_len)
    if name in SHAPED_MODELS:
        return SHAPED_MODELS[name]
    alias = MODEL_ALIASES.get(name)
    if alias is None:
        raise CostModelError(f"published model {name!r} has no preset mapping; add it to MODEL_ALIASES")
    return get_model_preset(alias)


def _train_kwargs(entry: dict[str, Any], setup: SourceSetup) -> dict[str, Any]:
    kw: dict[str, Any] = {"mode": "train", **setup.defaults}
    for key in _OPTION_KEYS:
        if key in entry:
            kw["zero_stage" if key == "zero" else key] = entry[key]
    options = entry.get("options")
    if options is not None:
        if options not in OPTION_BUNDLES:
            raise CostModelError(f"unknown option bundle {options!r}")
        kw.update(OPTION_BUNDLES[options])
    offload = entry.get("offload", "")
    if "optimizer" in offload:
        kw["offload_optimizer"] = True
    if "params" in offload:
        kw["offload_params"] = True
        kw["offload_optimizer"] = True
    if kw.get("offload_checkpoints") and kw.get("checkpointing", "full") == "none":
        kw["checkpointing"] = "full"
    if kw.get("offload_params"):
        kw["zero_stage"] = 3
    return kw


def _layout(entry: dict[str, Any]) -> Layout:
    degrees = {k: entry[k] for k in registry.innermost_first() if k in entry}
    if "pipeline" in entry:  # the published files say "pipeline" for the pp degree
        degrees["pp"] = entry["pipeline"]
    return Layout.for_world(entry["gpus"], **degrees, ep=expert_degree(entry)[0])


def _entry_model(entry: dict[str, Any], seq_len: int | None = None) -> ModelSpec:
    """The entry's model (sized for ``seq_len`` where its parameters depend on it), with the routing balance
    its source states."""
    model = _model(entry["model"], seq_len or entry.get("seq_len"))
    return with_load_imbalance(model, SOURCES[entry["source"]].moe_load_imbalance)


def _caveat_flags(entry: dict[str, Any]) -> dict[str, bool]:
    """Float8 linears and torch.compile, as torchtitan's tables state them in the caveat."""
    caveat = entry.get("caveat", "")
    return {"fp8_linears": "Float8" in caveat, "compiled": "compile" in caveat and "no torch.compile" not in caveat}


def _parallel_train(entry: dict[str, Any]) -> dict[str, Any]:
    """Train options of the entry's pipeline (schedule, virtual stages, split) and its micro-batches per step."""
    kw = pipeline_train(entry, _model(entry["model"], entry.get("seq_len")))
    if "grad_accum" in entry:  # micro-batches per step: what a pipeline's bubble depends on
        kw["grad_accum"] = entry["grad_accum"]
    return kw


def _run(id_: str, entry: dict[str, Any], metric: str, value: float, *, seq_len: int, group: str | None = None,
         extra_train: dict[str, Any] | None = None, model: ModelSpec | None = None, topology: str | None = None,
         layout: Layout | None = None, flop_convention: str = "model", assumed: str = "",
         scale_free: bool = False) -> MeasuredRun:
    source = entry["source"]
    setup = SOURCES[source]
    entry_train, entry_note = ENTRY_ASSUMPTIONS[source](entry) if source in ENTRY_ASSUMPTIONS else ({}, "")
    ep_note = expert_degree(entry)[1] if layout is None else ""
    assumed = "; ".join(x for x in (assumed, entry_note, ep_note) if x)
    kw = _train_kwargs(entry, setup) | entry_train | (extra_train or {})
    kw["seq_len"] = seq_len
    if kw.get("mode") == "prefill":
        kw.pop("zero_stage", None)
    train = TrainSpec(**kw)
    return MeasuredRun(
        id=id_, source=source, metric=metric, value=float(value), confidence=entry.get("confidence", "exact"),
        caveat=entry.get("caveat", ""), group=group, model=model or _entry_model(entry, seq_len), train=train,
        layout=layout or _layout(entry), topology=topology or setup.topology, stack=setup.stack,
        memory_overrides=dict(setup.memory_overrides),
        time_overrides=dict(setup.time_overrides) | dict(entry.get("stack_time", {})),  # the entry's own recipe
        flop_convention=flop_convention,  # type: ignore[arg-type]
        scale_free=scale_free,
        assumed="; ".join(x for x in (setup.note, assumed) if x),
    )


def _describe(entry: dict[str, Any], seq_len: int | None = None) -> str:
    named = {**entry, "pp": entry["pipeline"]} if "pipeline" in entry else entry
    layout = "x".join(f"{k}{named[k]}" for k in registry.innermost_first() if k in named and named[k] > 1) or "dp"
    seq = f" {seq_len // 1000}K" if seq_len else ""
    opts = f" {entry['options']}" if "options" in entry else ""
    extra = "".join(f" {label}{entry[key]}" for key, label in (("zero", "zero"), ("checkpointing", "ckpt-"))
                    if key in entry)
    extra += " ckpt-offload" if entry.get("offload_checkpoints") else ""
    extra += f" offload-{entry['offload']}" if "offload" in entry else ""
    extra += f" ep{entry['ep']}" if entry.get("ep", 1) > 1 else ""
    extra += f" {entry['variant']}" if "variant" in entry else ""  # rows of one table that differ in software only
    extra += f" {entry['schedule']}" if "schedule" in entry else ""
    extra += f" vp{entry['virtual_stages']}" if entry.get("virtual_stages", 1) > 1 else ""
    # a table archived per release repeats a layout across releases and precisions: both tell its rows apart
    extra += f" {entry.get('precision', 'bf16')} r{entry['release']}" if "release" in entry else ""
    return f"{entry['source']}: {entry['model'].split(' (')[0]} {entry['gpus']}gpu {layout}{seq}{opts}{extra}"


def published_runs() -> tuple[list[MeasuredRun], list[Skipped]]:
    """Every entry of the published file as a run (or a skip with its reason)."""
    data = published_entries()
    runs: list[MeasuredRun] = []
    skipped: list[Skipped] = []

    for entry in data.get("memory", []):
        metric = entry["metric"]
        if metric not in METRICS:
            skipped.append(Skipped(_describe(entry), entry["source"], f"unknown metric {metric}"))
            continue
        extra = {k: True for k, on in _caveat_flags(entry).items() if on} | _parallel_train(entry)
        runs.append(_run(_describe(entry, entry["seq_len"]) + f" [{metric}]", entry, metric, entry["value"],
                         seq_len=entry["seq_len"], extra_train=extra))

    for entry in data.get("max_length", []):
        run = _run(_describe(entry) + " [max len]", entry, "max_seq_len", entry["value"], seq_len=1 << 14)
        runs.append(run.model_copy(update={"failed_at": entry["failed_at"]}) if "failed_at" in entry else run)

    for entry in data.get("throughput", []):
        source = entry["source"]
        extra = _caveat_flags(entry)
        if "micro_batch" in entry:
            extra["micro_batch"] = entry["micro_batch"]
        if "global_batch" in entry:  # Megatron tables: precision from the source's defaults, not a caveat
            extra = {"grad_accum": global_batch_accumulation(entry)} | (
                {"micro_batch": entry["micro_batch"]} if "micro_batch" in entry else {})
        extra |= _parallel_train(entry)
        convention = {"ulysses-paper-figures": "megatron_deepspeed", "nemo-long-sequence": "nemo_llama"}.get(source,
                                                                                                          "model")
        topology = SYSTEM_TOPOLOGIES[entry["system"]] if "system" in entry else None
        table = entry.get("table") or f"{source}: {_model(entry['model'], entry.get('seq_len')).name}"
        if "points" in entry:
            for seq, value in entry["points"].items():
                runs.append(_run(_describe(entry, seq) + f" [{entry['metric']}]", entry, entry["metric"], value,
                                 seq_len=int(seq), group=table, extra_train=extra,
                                 flop_convention=convention))
        else:
            metric, value, assumed = entry["metric"], entry["value"], ""
            if metric in JOB_TOTAL_METRICS:
                metric, value = JOB_TOTAL_METRICS[metric], value / entry["gpus"]
                assumed = f"published {entry['value']:g} {entry['metric']} / {entry['gpus']} GPUs"
            runs.append(_run(_describe(entry, entry["seq_len"]) + f" [{metric}]", entry, metric,
                             value, seq_len=entry["seq_len"], group=table,
                             extra_train=extra, flop_convention=convention, topology=topology, assumed=assumed))

    for entry in data.get("kernel", []):
        source = entry["source"]
        if source == "usp-attention":
            hardware = entry["hardware"]
            topology = "l20-pcie" if "L20" in hardware else "dgx-a100"
            group = f"usp {hardware.split(' ')[2]} {entry['seq_len'] // 1024}K"
            for name, value in entry["points"].items():
                degrees = _usp_degrees(name)
                layout = Layout.for_world(8, **degrees)
                runs.append(_run(f"usp-attention: {group} {name}", {**entry, "gpus": 8, "model": "usp"},
                                 "iters_per_s", value, seq_len=entry["seq_len"], group=group,
                                 model=USP_ATTENTION_MODEL, topology=topology, layout=layout, scale_free=True,
                                 assumed=USP_SCALE_NOTE))
        elif source == "megatron-recompute":
            model = _model(entry["model"])
            for name, (fwd, bwd) in entry["points"].items():
                ckpt = {"no_recompute": "none", "full_recompute": "full", "selective": "selective",
                        "selective_sp": "selective"}[name]
                extra = {"checkpointing": ckpt, "tp_sequence_parallel": name == "selective_sp"}
                layout = Layout.for_world(8, tp=8)
                for metric, value in (("layer_fwd_ms", fwd), ("layer_bwd_ms", bwd)):
                    runs.append(_run(f"megatron-recompute: 22B layer {name} {metric[6:9]}",
                                     {**entry, "gpus": 8}, metric, value, seq_len=2048,
                                     group=f"megatron-recompute {metric[6:9]}", extra_train=extra, model=model,
                                     layout=layout))
        else:
            skipped.append(Skipped(source, source, "unknown kernel source"))
    return runs, skipped


def _usp_degrees(name: str) -> dict[str, int]:
    """'ulysses4_ring2' -> {'ulysses': 4, 'ring': 2}."""
    degrees: dict[str, int] = {}
    for part in name.split("_"):
        for dim in ("ulysses", "ring"):
            if part.startswith(dim):
                degrees[dim] = int(part[len(dim):])
    return degrees


__all__ = ["MODEL_ALIASES", "SOURCES", "Skipped", "published_runs"]
