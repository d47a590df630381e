"""``sp-plan export --to megatron`` (issue 19, item 4): the argument set of Megatron-LM's pretrain_gpt.py.

The consumer checks:

- megatron-core (the registry's ``megatron-core`` wheel, the [test] extra) defines the model and parallelism
  flags as fields of its config dataclasses (Megatron-LM's arguments.py generates those flags from the fields,
  ``--`` + the field name with dashes unless the field's ``argparse_meta`` names another). The exported
  arguments are parsed by a parser built from those fields plus the few flags pretrain_gpt.py's own argument
  groups add (:data:`SCRIPT_FLAGS`); an unknown flag fails, and megatron-core's ``TransformerConfig``,
  ``DistributedDataParallelConfig`` and ``OptimizerConfig`` are then built from the values, so their own
  validation (heads vs. TP, query groups, recompute settings, CP sizes) runs on them.
- Megatron-LM itself (``megatron/training/arguments.py``, not shipped by any registry package): where a checkout
  is given (``MEGATRON_LM_ROOT``), its ``parse_args`` and ``validate_args`` run on the exported argv with the
  plan's world size, skipped otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import re
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path
from unittest import mock

import pytest

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.export import EXPORTERS, target_stack
from sp_plan.planner.export_megatron import megatron_arguments, megatron_refusal, to_megatron
from sp_plan.planner.plan import Hardware, Plan

SP_PLAN = str(Path(sys.executable).with_name("sp-plan"))
MEGATRON_TRAIN = dict(zero_stage=1, tiled_loss=False, tiled_mlp=False)


def make_plan(gpus: int = 8, per_node: int = 8, model: str = "llama3-8b", seq_len: int = 131072,
              assume: dict | None = None, stack: str = "megatron-core", **degrees_and_options) -> Plan:
    degrees = {k: v for k, v in degrees_and_options.items() if k in Layout.model_fields}
    options = {k: v for k, v in degrees_and_options.items() if k not in degrees}
    return Plan(model=get_model_preset(model), train=TrainSpec(seq_len=seq_len, **{**MEGATRON_TRAIN, **options}),
                layout=Layout.for_world(gpus, **degrees),
                hardware=Hardware(num_gpus=gpus, gpus_per_node=per_node, gpu="h100-80gb", topology="dgx-h100"),
                assume=assume or {}, stack=stack)


#: Plans that cover each mapping: ring only (p2p), Ulysses only (a2a), both (a2a+p2p), TP with sequence
#: parallelism, replicated optimizer instances, every recompute granularity, optimizer offload, micro-batches,
#: plain DDP (ZeRO-0), TP beyond the KV heads.
PLANS = {
    "ring": lambda: make_plan(ring=8, checkpointing="full"),
    "ulysses": lambda: make_plan(ulysses=8, checkpointing="selective"),
    "usp-tp": lambda: make_plan(gpus=16, ring=2, ulysses=2, tp=2, checkpointing="none"),
    "replicas": lambda: make_plan(gpus=16, dp_replicate=2, tp=2, ulysses=2, seq_len=32768, micro_batch=2,
                                  grad_accum=4),
    "offload": lambda: make_plan(model="llama3-70b", gpus=16, tp=8, ring=2, offload_optimizer=True),
    "dp": lambda: make_plan(gpus=8, seq_len=8192, zero_stage=0, checkpointing="none"),
    # TP beyond the 8 KV heads: megatron-core >= 0.16 gives each TP rank one replicated query group
    "tp-over-kv": lambda: make_plan(gpus=16, tp=16, checkpointing="full"),
    # pipeline stages: 1F1B with the balanced split (a lighter last stage for the LM head), and interleaved
    "pp-1f1b": lambda: make_plan(gpus=32, pp=4, tp=8, seq_len=32768, grad_accum=8, pipeline_schedule="1f1b",
                                 stage_layers=(8, 9, 9, 6), checkpointing="full"),
    "pp-interleaved": lambda: make_plan(gpus=16, pp=2, tp=8, seq_len=32768, grad_accum=4,
                                        pipeline_schedule="interleaved_1f1b", virtual_stages=2,
                                        stage_layers=(16, 16), checkpointing="full"),
    # mixture of experts with expert parallelism over the Ulysses x data ranks (issue 20), and DeepSeek-V3's
    # latent attention, shared expert and three dense layers under pipeline stages Megatron can split
    "moe-ep": lambda: make_plan(model="qwen3-30b-a3b", gpus=16, ulysses=4, dp_shard=4, ep=8, seq_len=32768,
                                checkpointing="full"),
    # the overlaps the megatron stack prices: MoE all-to-alls behind another micro-batch (no full recompute, two
    # micro-batches), TP communication inside the GEMMs
    "moe-a2a-overlap": lambda: make_plan(model="qwen3-30b-a3b", gpus=16, tp=2, ulysses=2, dp_shard=4, ep=8,
                                         seq_len=32768, checkpointing="selective", grad_accum=2),
    # Megatron-Bridge's Llama 3.1 405B recipe: 126 layers over PP 8 x VP 8, the embedding and the loss each
    # counted as a layer (15 layers on the first and last stage, 16 on the others)
    "pp-head-chunks": lambda: make_plan(model="llama3-405b", gpus=128, pp=8, tp=8, ring=2, seq_len=8192,
                                        grad_accum=8, pipeline_schedule="interleaved_1f1b", virtual_stages=8,
                                        checkpointing="none"),
    # fused cross-entropy (priced with --assume): Megatron's native fusion and Transformer Engine's
    "fused-ce-native": lambda: make_plan(ulysses=8, checkpointing="full",
                                         assume={"cross_entropy_implementation": "megatron_fused"}),
    "fused-ce-te": lambda: make_plan(gpus=16, tp=2, ring=8, checkpointing="full",
                                     assume={"cross_entropy_implementation": "te_fused"}),
    "mla-moe-pp": lambda: make_plan(model="deepseek-v3", gpus=64, pp=8, ulysses=8, ep=8, seq_len=32768,
                                    grad_accum=8, pipeline_schedule="1f1b", stage_layers=(6, 8, 8, 8, 8, 8, 8, 7),
                                    checkpointing="full"),
}


def flags_of(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


# ----- the argument set ------------------------------------------------------------------------------


def test_megatron_is_a_registered_export_target_that_runs_the_megatron_core_stack():
    assert "megatron" in EXPORTERS and target_stack(make_plan(ring=8), "megatron") == "megatron-core"


@pytest.mark.parametrize("layout, cp_args", [
    (dict(ring=8), ["--context-parallel-size", "8", "--cp-comm-type", "p2p"]),
    (dict(ulysses=8), ["--context-parallel-size", "8", "--cp-comm-type", "a2a"]),
    (dict(ring=4, ulysses=2), ["--context-parallel-size", "8", "--cp-comm-type", "a2a+p2p",
                               "--hierarchical-context-parallel-sizes", "2", "4"]),
    (dict(dp_shard=8), []),
])
def test_context_parallel_is_ring_ulysses_or_both(layout, cp_args):
    argv = list(megatron_arguments(make_plan(**layout)).argv)
    if cp_args:
        start = argv.index("--context-parallel-size")
        assert argv[start:start + len(cp_args)] == cp_args
    else:
        assert "--context-parallel-size" not in argv and "--cp-comm-type" not in argv


def test_model_shape_batch_and_techniques_come_from_the_plan():
    plan = PLANS["replicas"]()
    args = megatron_arguments(plan)
    argv = list(args.argv)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    model = plan.model
    assert (value("--num-layers"), value("--hidden-size"), value("--ffn-hidden-size")) == \
        (str(model.num_layers), str(model.hidden_size), str(model.ffn_hidden_size))
    assert value("--num-query-groups") == str(model.num_kv_heads) and "--group-query-attention" in argv
    assert value("--kv-channels") == str(model.head_dim) and value("--seq-length") == "32768"
    assert value("--tensor-model-parallel-size") == "2" and "--sequence-parallel" in argv
    assert value("--num-distributed-optimizer-instances") == "2" and "--use-distributed-optimizer" in argv
    # global batch = micro-batch x accumulation x data-parallel ranks (dp_replicate x dp_shard = 16/4)
    assert value("--micro-batch-size") == "2" and value("--global-batch-size") == str(2 * 4 * 4)
    # NullTokenizer adds the end-of-document token; padding only to a multiple of tp, as planned
    assert value("--vocab-size") == str(model.vocab_size - 1) and value("--make-vocab-size-divisible-by") == "1"
    assert dict(args.env) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    full = list(megatron_arguments(PLANS["ring"]()).argv)
    assert full[full.index("--recompute-granularity"):][:6] == [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    none = list(megatron_arguments(PLANS["usp-tp"]()).argv)
    assert "--recompute-granularity" not in none
    offload = list(megatron_arguments(PLANS["offload"]()).argv)
    assert {"--optimizer-cpu-offload", "--use-precision-aware-optimizer"} <= set(offload)
    ddp = list(megatron_arguments(PLANS["dp"]()).argv)
    assert "--use-distributed-optimizer" not in ddp and "--sequence-parallel" not in ddp


@pytest.mark.parametrize("plan, reason", [
    (lambda: make_plan(ulysses=8, zero_stage=3), "Megatron's distributed optimizer is ZeRO-1"),
    (lambda: make_plan(ulysses=8, tiled_mlp=True), "no a tiled MLP"),
    (lambda: make_plan(ulysses=8, zero_stage=3, offload_params=True, offload_optimizer=True), "ZeRO-1"),
    (lambda: make_plan(ulysses=8, checkpointing="full", offload_checkpoints=True), "checkpoint offload"),
    (lambda: make_plan(gpus=16, ulysses=16), "ulysses=16 does not divide the 8 KV heads per TP rank"),
    (lambda: make_plan(gpus=32, tp=16, ulysses=2), "ulysses=2 does not divide the 1 KV heads per TP rank"),
    (lambda: make_plan(dp_replicate=2, dp_shard=4, zero_stage=0), "no replicate/shard split"),
    (lambda: make_plan(ring=8, seq_len=131064), "sequence 131064 does not divide into 2 x 8 chunks"),
    (lambda: make_plan(ring=8, mode="prefill", zero_stage=0), "pretrain_gpt.py trains"),
])
def test_plans_megatron_cannot_run_are_refused_with_the_reason(plan, reason):
    p = plan()
    assert reason in (megatron_refusal(p) or "")
    with pytest.raises(PlannerError, match="Megatron-LM cannot run this plan"):
        to_megatron(p)


def test_a_model_field_the_export_does_not_map_is_refused_not_dropped():
    """A model with a field the arguments do not express (a sliding window, experts, latent attention: here a
    ModelSpec subclass with one such field) must not export as the dense model it is not; at its default the
    field changes nothing and the plan exports."""
    from sp_plan.cost_models.model_spec import ModelSpec
    from sp_plan.planner import export_megatron

    class Windowed(ModelSpec):
        sliding_window: int | None = None

    base = PLANS["ring"]()
    windowed = Windowed(**{**base.model.model_dump(), "sliding_window": 4096})
    plan = base.model_copy(update={"model": windowed})
    assert "model field sliding_window=4096 has no mapping" in export_megatron.megatron_refusal(plan)
    plain = base.model_copy(update={"model": Windowed(**base.model.model_dump())})
    assert export_megatron.megatron_refusal(plain) is None


def test_the_script_is_bash_whose_arrays_are_the_argv(tmp_path):
    exported = to_megatron(PLANS["usp-tp"]())
    script = tmp_path / "megatron.sh"
    script.write_text(exported.content)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    # the arrays, as bash expands them, are exactly the argv (bash prints each element on its own line)
    body = exported.content.rsplit("\n", 1)[0]
    probe = body + '\nprintf "%s\\n" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == exported.data["argv"]
    assert exported.content.splitlines()[-1].startswith("torchrun --nnodes=2 --nproc-per-node=8 --node-rank=$NODE_RANK")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in exported.content
    assert shlex.split(exported.data["command"])[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1"


def test_the_console_script_exports_a_megatron_plan_as_script_and_json(tmp_path):
    plan = tmp_path / "plan.yaml"
    made = subprocess.run([SP_PLAN, "plan", "--model", "llama3-8b", "--seq-len", "64K", "--gpus", "8", "--stack",
                           "megatron", "--out", str(plan)], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    as_json = subprocess.run([SP_PLAN, "export", str(plan), "--to", "megatron", "--json"], capture_output=True,
                             text=True, timeout=120)
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["stack"] == "megatron-core" and data["argv"] == data["model_args"] + data["parallel_args"] + \
        data["data_args"]
    assert any("under the megatron-core stack" in n for n in data["notes"])  # re-checked under the stack
    assert "--cross-entropy-loss-fusion" not in data["argv"]  # the stack's own loss is Megatron's unfused one
    out = tmp_path / "megatron.sh"
    text = subprocess.run([SP_PLAN, "export", str(plan), "--to", "megatron", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert out.read_text().startswith("#!/usr/bin/env bash") and "pretrain_gpt.py" in out.read_text()
    helped = subprocess.run([SP_PLAN, "export", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "megatron" in helped


# ----- fused cross-entropy: the flags follow the loss the plan was priced with ---------------------------


def _cross_entropy_flags(argv) -> list[str]:
    argv = list(argv)
    found = [a for a in argv if a == "--cross-entropy-loss-fusion"]
    if "--cross-entropy-fusion-impl" in argv:
        i = argv.index("--cross-entropy-fusion-impl")
        found += argv[i:i + 2]
    return found


def test_fused_cross_entropy_flags_follow_the_assumed_loss_or_a_megatron_stack_file(tmp_path):
    from sp_plan.cost_models import data as shipped
    from sp_plan.planner.export import check_under_stack

    assert _cross_entropy_flags(megatron_arguments(make_plan(ulysses=8)).argv) == []
    native = make_plan(ulysses=8, assume={"cross_entropy_implementation": "megatron_fused"})
    assert _cross_entropy_flags(megatron_arguments(native).argv) == [
        "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]
    # an edited copy of megatron-core.yaml (it keeps its name) that runs Transformer Engine's loss: the plan's stack
    stack = tmp_path / "megatron-te-ce.yaml"
    text = shipped.read_text("stacks", "megatron-core")
    stack.write_text(text.replace("cross_entropy_implementation: megatron ", "cross_entropy_implementation: te_fused "))
    te = make_plan(ulysses=8, stack=str(stack))
    assert target_stack(te, "megatron") == str(stack)  # checked under the plan's own Megatron stack file
    exported = to_megatron(te)
    assert _cross_entropy_flags(exported.data["argv"]) == ["--cross-entropy-loss-fusion",
                                                            "--cross-entropy-fusion-impl", "te"]
    assert any("later Megatron-LM refuses it" in n for n in exported.notes)
    # the export's --stack decides for a plan made under another stack; an --assume in the plan wins over both
    assert _cross_entropy_flags(to_megatron(make_plan(ulysses=8, stack="sp-plan"), str(stack)).data["argv"])[-1] == "te"
    assert _cross_entropy_flags(to_megatron(native, str(stack)).data["argv"])[-1] == "native"
    # the re-check prices the assumed loss: at 256K the unfused loss's logits do not fit on an H100, the fused do
    with pytest.raises(PlannerError, match="needs 9.* GB per GPU, over the"):
        check_under_stack(make_plan(ulysses=8, seq_len=262144), "megatron")
    fused = make_plan(ulysses=8, seq_len=262144, assume={"cross_entropy_implementation": "megatron_fused"})
    assert "predicted to need 8" in check_under_stack(fused, "megatron")[0]


def test_an_assumed_fused_loss_round_trips_through_the_plan_file_to_the_export(tmp_path):
    plan = tmp_path / "plan.yaml"
    made = subprocess.run([SP_PLAN, "plan", "--model", "llama3-8b", "--seq-len", "64K", "--gpus", "8", "--stack",
                           "megatron", "--assume", "cross_entropy_implementation=megatron_fused", "--out", str(plan)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "cross_entropy_implementation: megatron_fused" in plan.read_text()
    exported = subprocess.run([SP_PLAN, "export", str(plan), "--to", "megatron", "--json"], capture_output=True,
                              text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    argv = json.loads(exported.stdout)["argv"]
    assert _cross_entropy_flags(argv) == ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]
    configs, _ = parse_with_megatron_core(argv)
    assert configs["TransformerConfig"].cross_entropy_loss_fusion


def test_a_plan_file_refuses_an_unknown_assumption():
    with pytest.raises(ValueError, match="unknown memory assumptions"):
        make_plan(ulysses=8, assume={"cross_entropy": "fused"})


def test_the_console_script_refuses_a_zero3_plan_in_one_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    make_plan(ulysses=8, zero_stage=3).save(plan)
    result = subprocess.run([SP_PLAN, "export", str(plan), "--to", "megatron"], capture_output=True, text=True,
                            timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "re-plan with --stack megatron" in lines[0], result.stderr


# ----- consumer 1: megatron-core's own config classes (registry package) ----------------------------------

#: Flags pretrain_gpt.py's argument groups define outside megatron-core's config dataclasses (Megatron-LM
#: core_v0.16.1 arguments.py: _add_network_size_args, _add_training_args, _add_distributed_args,
#: _add_data_args, _add_tokenizer_args), and what each becomes in megatron-core's configs (None: a model-,
#: data- or schedule-level value that is no config field).
SCRIPT_FLAGS: dict[str, tuple[dict, dict | None]] = {
    "--seq-length": ({"type": int}, None),
    "--max-position-embeddings": ({"type": int}, None),
    "--position-embedding-type": ({"choices": ["learned_absolute", "rope", "mrope", "yarn", "none"]}, None),
    "--group-query-attention": ({"action": "store_true"}, None),
    "--swiglu": ({"action": "store_true"}, {"gated_linear_unit": True}),
    "--untie-embeddings-and-output-weights": ({"action": "store_true"}, None),
    "--micro-batch-size": ({"type": int}, None),
    "--global-batch-size": ({"type": int}, None),
    "--mock-data": ({"action": "store_true"}, None),
    "--tokenizer-type": ({"choices": ["NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"]}, None),
    "--vocab-size": ({"type": int}, None),
    "--make-vocab-size-divisible-by": ({"type": int}, None),
    # _add_distributed_args: the pipeline split and interleaving (core_v0.16.1 arguments.py 2209-2231); their
    # values become TransformerConfig fields (VALUE_FLAGS)
    "--decoder-first-pipeline-num-layers": ({"type": int}, None),
    "--decoder-last-pipeline-num-layers": ({"type": int}, None),
    "--num-virtual-stages-per-pipeline-rank": ({"type": int}, None),
    # _add_moe_args (arguments.py 2691): the expert count; core_transformer_config_from_args renames it
    "--num-experts": ({"type": int}, None),
}
#: Script flags whose value validate_args hands to a megatron-core config field.
VALUE_FLAGS = {"--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
               "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
               "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
               "--num-experts": "num_moe_experts"}


def megatron_layer_pattern(text: str) -> int | list[int]:
    """Megatron-LM's ``moe_freq_type`` (arguments.py 231): an int, or a list expression of digits, brackets,
    commas, ``+`` and ``*`` that it evaluates (its ``_eval_pattern`` rule, applied here the same way)."""
    if "[" not in text:
        return int(text)
    if re.search(r"[^,\d\[\]\(\)\+\*]", text):
        raise ValueError(f"Invalid pattern: {text}")
    return eval(text)  # noqa: S307 - the character check above is Megatron's own guard


#: Config fields whose flag Megatron-LM parses with its own type function rather than the field's annotation.
FIELD_TYPES = {"moe_layer_freq": megatron_layer_pattern}


def _config_classes():
    """megatron-core's config classes whose fields are flags: ``TransformerConfig`` first (its flags are
    Megatron-LM's; ``MLATransformerConfig`` only adds the latent fields, whose defaults differ, e.g. its
    ``multi_latent_attention`` is on), then what core_transformer_config_from_args builds under
    ``--multi-latent-attention``."""
    core = pytest.importorskip("megatron.core", reason="megatron-core (the [test] extra) is not installed")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return core, (TransformerConfig, MLATransformerConfig, DistributedDataParallelConfig, OptimizerConfig)


def _argparse_kwargs(field: dataclasses.Field, hints: dict) -> tuple[list[str], dict]:
    """The flag(s) and argparse settings Megatron-LM derives from a megatron-core config field (its
    ArgumentGroupFactory's rule: ``--name-with-dashes``; booleans are switches; a field's ``argparse_meta``
    overrides)."""
    kind = hints[field.name]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = typing.get_args(kind)[0]
    names = ["--" + field.name.replace("_", "-")]
    if kind is bool:
        kwargs = {"action": "store_false" if field.default is True else "store_true"}
        if field.default is True:
            names = ["--no-" + field.name.replace("_", "-"), "--disable-" + field.name.replace("_", "-")]
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs = {"type": kind.__getitem__}
    elif typing.get_origin(kind) is list:
        kwargs = {"type": typing.get_args(kind)[0], "nargs": "+"}
    elif typing.get_origin(kind) is typing.Literal:
        kwargs = {"choices": list(typing.get_args(kind))}
    elif kind in (int, float, str):
        kwargs = {"type": kind}
    else:
        kwargs = {}
    if field.name in FIELD_TYPES:
        kwargs = {"type": FIELD_TYPES[field.name]}
    meta = dict(field.metadata.get("argparse_meta", {}))
    names = meta.pop("arg_names", names)
    meta.pop("default", None)
    return names, {**kwargs, **{k: v for k, v in meta.items() if k in ("type", "nargs", "choices", "action")}}


def parse_with_megatron_core(argv: list[str]):
    """The exported argv through a parser of megatron-core's config fields and the script flags; returns the
    megatron-core configs built from it (keyed by class name; the transformer's as ``TransformerConfig``)."""
    _, classes = _config_classes()
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    dests: dict[str, set[str]] = {}
    seen: set[str] = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        dests[cls.__name__] = set()
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            names, kwargs = _argparse_kwargs(field, hints)
            dests[cls.__name__].add(field.name)
            if field.name in seen:
                continue
            seen.add(field.name)
            parser.add_argument(*names, dest=field.name, default=argparse.SUPPRESS, **kwargs)
    for flag, (kwargs, _) in SCRIPT_FLAGS.items():
        parser.add_argument(flag, dest="script:" + flag, default=argparse.SUPPRESS, **kwargs)
    parsed, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ValueError(f"flags Megatron does not define: {unknown}")
    values = vars(parsed)
    script = {k: v for k, v in values.items() if k.startswith("script:")}
    fields = {k: v for k, v in values.items() if not k.startswith("script:")}
    for flag, value in script.items():
        name = flag.split(":", 1)[1]
        fields.update(SCRIPT_FLAGS[name][1] or {})
        if name in VALUE_FLAGS:
            fields[VALUE_FLAGS[name]] = value
    if fields.get("pipeline_model_parallel_size", 1) > 1:  # core_transformer_config_from_args (arguments.py 1325)
        import torch

        fields["pipeline_dtype"] = torch.bfloat16 if fields.get("bf16") else torch.float32
    # OptimizerConfig asks Transformer Engine (a CUDA package, absent here) for its version when the precision-
    # aware optimizer is on; the stack runs TE 2.x, so the probe answers as that.
    with mock.patch("megatron.core.optimizer.optimizer_config.is_te_min_version", lambda *a, **k: True):
        transformer = classes[1] if fields.get("multi_latent_attention") else classes[0]
        configs = {("TransformerConfig" if cls is transformer else cls.__name__):
                   cls(**{k: v for k, v in fields.items() if k in dests[cls.__name__]})
                   for cls in (transformer, *classes[2:])}
    return configs, script


@pytest.mark.parametrize("name", sorted(PLANS))
def test_megatron_core_parses_and_validates_the_exported_arguments(name):
    plan = PLANS[name]()
    args = megatron_arguments(plan)
    configs, script = parse_with_megatron_core(list(args.argv))
    tc = configs["TransformerConfig"]
    layout = plan.layout
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads) == \
        (plan.model.num_layers, plan.model.hidden_size, plan.model.num_heads)
    model = plan.model
    if model.mla is None:
        assert tc.num_query_groups == model.num_kv_heads and tc.kv_channels == model.head_dim
    else:  # latent attention: Megatron's qk_head_dim is the content part, qk_pos_emb_head_dim the RoPE part
        assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == (
            model.mla.q_lora_rank, model.mla.kv_lora_rank, model.mla.qk_nope_head_dim, model.mla.qk_rope_head_dim,
            model.mla.v_head_dim)
        assert tc.qk_head_dim + tc.qk_pos_emb_head_dim == model.head_dim and tc.multi_latent_attention
    assert tc.expert_model_parallel_size == layout.ep
    if model.moe is None:
        assert tc.num_moe_experts is None
    else:
        moe = model.moe
        assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (
            moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size)
        assert (tc.moe_shared_expert_intermediate_size or 0) == moe.shared_width
        freq = tc.moe_layer_freq
        moe_layers = [i for i in range(model.num_layers) if (freq[i] if isinstance(freq, list) else i % freq == 0)]
        assert len(moe_layers) == model.moe_layer_count and not set(moe.dense_layers) & set(moe_layers)
        assert tc.moe_grouped_gemm and tc.moe_token_dispatcher_type == "alltoall"
    assert tc.gated_linear_unit and not tc.add_bias_linear and tc.normalization == "RMSNorm"
    assert tc.tp_comm_overlap == (layout.tp > 1)  # every test plan with TP has sequence parallelism
    assert tc.tensor_model_parallel_size == layout.tp and tc.pipeline_model_parallel_size == layout.pp
    assert tc.virtual_pipeline_model_parallel_size == (plan.train.virtual_stages if layout.pp > 1 and
                                                       plan.train.virtual_stages > 1 else None)
    if layout.pp > 1:
        from sp_plan.cost_models.pipeline import stage_layers

        split = stage_layers(plan.model, plan.train, layout)
        assert megatron_stage_layers(tc) == split  # the layers Megatron builds on each stage, as planned
    assert tc.context_parallel_size == layout.ulysses * layout.ring
    assert tc.sequence_parallel == (layout.tp > 1) and tc.bf16
    assert tc.recompute_granularity == {"full": "full", "selective": "selective", "none": None}[plan.train.checkpointing]
    if layout.ulysses > 1 and layout.ring > 1:
        assert tc.cp_comm_type == "a2a+p2p" and tc.hierarchical_context_parallel_sizes == [layout.ulysses, layout.ring]
    ddp = configs["DistributedDataParallelConfig"]
    assert ddp.use_distributed_optimizer == (plan.train.zero_stage == 1)
    assert ddp.num_distributed_optimizer_instances == layout.dp_replicate
    assert configs["OptimizerConfig"].optimizer_cpu_offload == plan.train.offload_optimizer
    assert script["script:--seq-length"] == plan.train.seq_len
    fusion = {"megatron_fused": "native", "te_fused": "te"}.get(plan.assume.get("cross_entropy_implementation"))
    assert tc.cross_entropy_loss_fusion == (fusion is not None)
    assert tc.cross_entropy_fusion_impl == (fusion or "native")  # native is the default when not fused


def megatron_stage_layers(tc) -> tuple[int, ...]:
    """The decoder layers Megatron-Core builds on each pipeline rank, from its TransformerConfig the way
    ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` count them: the first and last ranks' own
    counts, or, with the embedding or the loss counted as a layer, every rank holding the same slots less those;
    else an even split."""
    p, layers = tc.pipeline_model_parallel_size, tc.num_layers
    first, last = tc.num_layers_in_first_pipeline_stage, tc.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        ends = (first or 0) + (last or 0)
        middle_ranks = p - (first is not None) - (last is not None)
        middle = (layers - ends) // middle_ranks if middle_ranks else 0
        return (first if first is not None else middle, *[middle] * (p - 2), last if last is not None else middle)
    embedding, loss = int(tc.account_for_embedding_in_pipeline_split), int(tc.account_for_loss_in_pipeline_split)
    per = (layers + embedding + loss) // p
    return (per - embedding, *[per] * (p - 2), per - loss)


def test_megatron_counts_the_embedding_and_the_loss_as_layers_for_the_405b_split():
    """The 405B recipe's split (15, 16 x 6, 15) with 8 chunks per stage: no first/last layer counts can express it
    (15 does not divide into 8 chunks); Megatron runs it by counting the embedding and the loss as layers."""
    plan = PLANS["pp-head-chunks"]()
    from sp_plan.cost_models.pipeline import stage_layers

    assert stage_layers(plan.model, plan.train, plan.layout) == (15, *[16] * 6, 15)
    assert megatron_refusal(plan) is None
    argv = list(megatron_arguments(plan).argv)
    assert "--account-for-embedding-in-pipeline-split" in argv and "--account-for-loss-in-pipeline-split" in argv
    assert "--decoder-first-pipeline-num-layers" not in argv
    configs, _ = parse_with_megatron_core(argv)  # megatron-core's own divisibility checks run on it
    assert configs["TransformerConfig"].account_for_embedding_in_pipeline_split
    uneven = make_plan(model="llama3-405b", gpus=128, pp=8, tp=8, ring=2, seq_len=8192, grad_accum=8,
                       pipeline_schedule="interleaved_1f1b", virtual_stages=8, checkpointing="none",
                       stage_layers=(14, *[16] * 6, 16))
    assert "counted as a layer each" in megatron_refusal(uneven)


def test_a_flag_megatron_core_does_not_know_fails_the_parse():
    argv = list(megatron_arguments(PLANS["ring"]()).argv)
    with pytest.raises(ValueError, match=r"flags Megatron does not define: \['--ulysses-degree', '8'\]"):
        parse_with_megatron_core(argv + ["--ulysses-degree", "8"])
    tp2 = list(megatron_arguments(PLANS["usp-tp"]()).argv)  # tp=2: megatron-core's own validation runs
    with pytest.raises(ValueError, match="num_query_groups"):
        parse_with_megatron_core([*tp2, "--num-query-groups", "3"])


# ----- consumer 2: Megatron-LM's own parse_args + validate_args (a checkout, when given) ---------------------


def _megatron_lm_arguments():
    """megatron.training.arguments from the checkout in MEGATRON_LM_ROOT (skip without one). Its package
    __init__ imports the whole trainer (Triton, TE); the argument module needs only global_vars, so the
    package is entered without running __init__."""
    root = os.environ.get("MEGATRON_LM_ROOT")
    if not root:
        pytest.skip("Megatron-LM's arguments.py ships in no registry package: set MEGATRON_LM_ROOT to a checkout "
                    "(tag core_v0.16.1 matches the megatron-core wheel) to run its own parser")
    # `megatron` is a namespace package (the wheel has no __init__): its path is recomputed from sys.path, so the
    # checkout joins it through sys.path (after the wheel's megatron.core), not by editing megatron.__path__.
    if root not in sys.path:
        sys.path.append(root)
    extra = str(Path(root) / "megatron")
    if "megatron.training" not in sys.modules:
        package = types.ModuleType("megatron.training")
        package.__path__ = [str(Path(extra) / "training")]
        sys.modules["megatron.training"] = package
        import megatron.training.global_vars as global_vars

        for name in dir(global_vars):
            if name.startswith(("get_", "set_")):
                setattr(package, name, getattr(global_vars, name))
    import megatron.training.arguments as arguments

    return arguments


@pytest.mark.parametrize("name", sorted(PLANS))
def test_megatron_lms_own_parser_accepts_the_exported_arguments(name, monkeypatch):
    arguments = _megatron_lm_arguments()
    plan = PLANS[name]()
    args = megatron_arguments(plan)
    for key, value in args.env:
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", str(plan.hardware.num_gpus))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *args.argv])
    # validate_args asks the first CUDA device for its architecture: the plan's GPU is a Hopper (9.0).
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(arguments.torch.cuda, "get_device_capability", lambda *a: (9, 0))  # grouped-GEMM check
    # validate_args ends by printing the arguments through the trainer's utils (which import the legacy model
    # package and Transformer Engine); every check runs before it.
    monkeypatch.setattr(arguments, "_print_args", lambda *a, **k: None)
    parsed = arguments.parse_args()
    arguments.validate_args(parsed)
    assert parsed.data_parallel_size == plan.layout.dp
    assert parsed.context_parallel_size == plan.layout.ulysses * plan.layout.ring
    assert parsed.accumulate_allreduce_grads_in_fp32  # the stack's fp32 main gradients


def test_experts_and_latent_attention_map_to_megatrons_moe_and_mla_flags():
    from sp_plan.planner.export_megatron import moe_layer_pattern

    assert moe_layer_pattern(61, (0, 1, 2)) == "[0]*3+[1]*58"
    assert moe_layer_pattern(6, (1, 3, 5)) == "[1]*1+[0]*1+[1]*1+[0]*1+[1]*1+[0]*1"
    assert megatron_layer_pattern(moe_layer_pattern(61, (0, 1, 2))) == [0] * 3 + [1] * 58
    argv = list(megatron_arguments(PLANS["mla-moe-pp"]()).argv)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert (value("--num-experts"), value("--moe-router-topk"), value("--moe-ffn-hidden-size")) == ("256", "8", "2048")
    assert value("--moe-shared-expert-intermediate-size") == "2048" and value("--expert-model-parallel-size") == "8"
    assert (value("--q-lora-rank"), value("--kv-lora-rank"), value("--qk-head-dim"), value("--qk-pos-emb-head-dim"),
            value("--v-head-dim")) == ("1536", "512", "128", "64", "128")
    assert "--group-query-attention" not in argv and "--kv-channels" not in argv
    dense = list(megatron_arguments(PLANS["ring"]()).argv)
    assert dense[dense.index("--expert-model-parallel-size") + 1] == "1" and "--num-experts" not in dense
    # a capacity factor is exported with the padding the planner priced
    plan = PLANS["moe-ep"]()
    capped = plan.model.model_copy(update={"moe": plan.model.moe.model_copy(update={"capacity_factor": 1.25})})
    argv = list(megatron_arguments(plan.model_copy(update={"model": capped})).argv)
    assert argv[argv.index("--moe-expert-capacity-factor") + 1] == "1.25" and "--moe-pad-expert-input-to-capacity" in argv
    assert any("router's score function" in note for note in to_megatron(PLANS["moe-ep"]()).notes)


def test_the_overlaps_the_megatron_stack_prices_are_exported():
    argv = list(megatron_arguments(PLANS["moe-a2a-overlap"]()).argv)
    assert "--overlap-moe-expert-parallel-comm" in argv and "--tp-comm-overlap" in argv
    full = list(megatron_arguments(PLANS["moe-ep"]()).argv)  # full recompute: Megatron refuses the a2a overlap
    assert "--overlap-moe-expert-parallel-comm" not in full and "--tp-comm-overlap" not in full  # and tp = 1
    # pp > 1: Megatron runs the overlap only under virtual stages, and the cost model prices it only there
    plan = make_plan(model="qwen3-30b-a3b", gpus=32, pp=2, ulysses=4, dp_shard=4, ep=8, seq_len=32768,
                     checkpointing="selective", grad_accum=4, pipeline_schedule="1f1b", stage_layers=(24, 24))
    assert "--overlap-moe-expert-parallel-comm" not in megatron_arguments(plan).argv
    chunked = plan.model_copy(update={"train": plan.train.model_copy(update={
        "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2})})
    assert "--overlap-moe-expert-parallel-comm" in megatron_arguments(chunked).argv
    # (megatron-core's TransformerConfig accepts it: the interleaved case's VP size goes with the flag)
    configs, _ = parse_with_megatron_core(list(megatron_arguments(chunked).argv))
    assert configs["TransformerConfig"].overlap_moe_expert_parallel_comm


def test_pipeline_plans_megatron_cannot_express_are_refused_with_a_split_it_can():
    plan = make_plan(gpus=32, pp=4, tp=8, seq_len=32768, grad_accum=8, pipeline_schedule="1f1b",
                     checkpointing="full")  # the balanced default split, (8, 8, 9, 7): an uneven middle
    reason = megatron_refusal(plan)
    assert reason is not None and "splits the stages between the first and the last evenly" in reason
    suggested = tuple(int(n) for n in reason.rsplit("--stage-layers ", 1)[1].split(","))
    assert sum(suggested) == 32 and len(set(suggested[1:-1])) == 1
    fixed = make_plan(gpus=32, pp=4, tp=8, seq_len=32768, grad_accum=8, pipeline_schedule="1f1b",
                      checkpointing="full", stage_layers=suggested)
    assert megatron_refusal(fixed) is None
    zero_bubble = make_plan(gpus=32, pp=4, tp=8, seq_len=32768, grad_accum=8, pipeline_schedule="zero_bubble")
    assert "not the zero-bubble schedule" in megatron_refusal(zero_bubble)
