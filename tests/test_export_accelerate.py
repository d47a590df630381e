"""The Accelerate YAML from `sp-plan export --to accelerate` passes Accelerate's own loading and checks.

``accelerate launch --config_file <export>`` is simulated up to the environment it hands the training
processes (accelerate's own argument validation and env preparation), then accelerate's
``ParallelismConfig`` and sequence-parallel handler are built from that environment and validated the
way ``Accelerator`` does. The Ulysses export (DeepSpeed ALST backend) and the plain FSDP export
(dp_shard 2) are also launched for real on 2 CPU ranks with a tiny script (Accelerate gives FSDP only to
GPU-type process groups: the script reports its gloo ranks as one, see tests/accelerate_tiny_train.py).
What each test pins down is a way the export used to fail: a TP-only plan that
accelerate refuses ('FSDP is enabled but the parallelism config has no dimension for FSDP to shard
across'), ``sp_seq_length`` ignored (``sp_seq_length_is_variable: true``), ``flash_attention_2``
hard-coded (needs flash-attn), gradient accumulation and micro-batch missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.export import to_accelerate
from sp_plan.planner.plan import Hardware, Plan
from tests.distributed import free_port

pytest.importorskip("accelerate")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
SCRIPT = Path(__file__).with_name("accelerate_tiny_train.py")
SEQ = 32


def make_plan(gpus: int = 2, **options) -> Plan:
    degrees = {k: options.pop(k) for k in ("ulysses", "ring", "tp", "dp_replicate", "dp_shard") if k in options}
    return Plan(
        model=get_model_preset("llama3-8b"),
        train=TrainSpec(seq_len=SEQ, **options),
        layout=Layout.for_world(gpus, **degrees),
        hardware=Hardware(num_gpus=gpus, gpus_per_node=gpus, gpu="h100-80gb", topology="hgx-h100"),
    )


def write_yaml(plan: Plan, path: Path) -> Path:
    path.write_text(yaml.safe_dump(to_accelerate(plan).content, sort_keys=False))
    return path


def launch_env(config_file: Path) -> tuple[SimpleNamespace, dict[str, str]]:
    """What `accelerate launch --config_file FILE train.py` validates and hands the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if not args.use_deepspeed:
        return args, prepare_multi_gpu_env(args)
    # As accelerate's launch_command does before its deepspeed_launcher.
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args, prepare_deepspeed_cmd_env(args)[1]


def validated_parallelism(env: dict[str, str], num_processes: int, monkeypatch, *, fsdp2: bool, deepspeed: bool):
    """accelerate's ParallelismConfig built from the launcher's environment, checked as Accelerator checks it."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    for key, value in env.items():
        if key.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    pc = ParallelismConfig()
    accelerator = SimpleNamespace(
        multi_device=True, num_processes=num_processes, is_fsdp2=fsdp2,
        distributed_type=DistributedType.DEEPSPEED if deepspeed else DistributedType.FSDP)
    pc._validate_accelerator(accelerator)
    return pc


@needs_deepspeed
def test_ulysses_yaml_through_accelerate_launch_validation(tmp_path, monkeypatch):
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    plan = make_plan(gpus=4, ulysses=2, zero_stage=3, grad_accum=4, micro_batch=2)
    args, env = launch_env(write_yaml(plan, tmp_path / "acc.yaml"))
    assert args.use_deepspeed and env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    pc = validated_parallelism(env, args.num_processes, monkeypatch, fsdp2=False, deepspeed=True)
    assert (pc.sp_size, pc.sp_backend, pc.dp_shard_size) == (2, "deepspeed", 2)
    handler = DeepSpeedSequenceParallelConfig()  # what ParallelismConfig builds for sp, from the same env
    # The planned length reaches ALST: with sp_seq_length_is_variable true it would be ignored.
    assert (handler.sp_seq_length, handler.sp_seq_length_is_variable) == (SEQ, False)
    assert handler.sp_attn_implementation == "sdpa"  # transformers' default; needs no flash-attn
    notes = "\n".join(to_accelerate(plan).notes)
    assert "batch_size=2 per process" in notes and "gradient_checkpointing_enable" in notes


@pytest.mark.parametrize(
    "degrees, fsdp_shard, cp",
    [({"dp_shard": 2}, 2, 1), ({"ring": 2}, 1, 2), ({"gpus": 4, "tp": 2}, 2, 1),
     ({"gpus": 4, "dp_replicate": 2}, 2, 1)],
)
def test_fsdp_yaml_through_accelerate_launch_validation(tmp_path, monkeypatch, degrees, fsdp_shard, cp):
    plan = make_plan(zero_stage=3, grad_accum=3, **degrees)
    args, env = launch_env(write_yaml(plan, tmp_path / "acc.yaml"))
    assert args.use_fsdp and str(args.fsdp_version) == "2" and env["ACCELERATE_USE_FSDP"] == "true"
    pc = validated_parallelism(env, args.num_processes, monkeypatch, fsdp2=True, deepspeed=False)
    assert (pc.dp_shard_size, pc.cp_size, pc.tp_size) == (fsdp_shard, cp, plan.layout.tp)
    assert pc.dp_replicate_size == plan.layout.dp_replicate and pc.total_size == plan.layout.world
    notes = "\n".join(to_accelerate(plan).notes)
    assert "Accelerator(gradient_accumulation_steps=3)" in notes and "batch_size=1 per process" in notes


def test_tp_only_plan_is_refused_before_accelerate_refuses_it(tmp_path, monkeypatch):
    """Accelerate itself rejects FSDP with nothing to shard; the export refuses first, naming the field."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    with pytest.raises(PlannerError, match=r"layout\.dp_shard=1 \(tp=2\).*--to deepspeed"):
        to_accelerate(make_plan(tp=2))
    accelerator = SimpleNamespace(multi_device=True, num_processes=2, is_fsdp2=True,
                                  distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match="no dimension for FSDP to shard across"):
        ParallelismConfig(tp_size=2)._validate_accelerator(accelerator)


def test_accelerate_refuses_checkpoint_offload_under_ulysses_naming_the_field():
    with pytest.raises(PlannerError, match=r"train\.offload_checkpoints.*--no-offload-checkpoints"):
        to_accelerate(make_plan(ulysses=2, checkpointing="full", offload_checkpoints=True))


def test_fsdp2_checkpoint_offload_is_trl_activation_offloading(tmp_path):
    """hf-fsdp2 prices offload_checkpoints as keeping every saved activation on the host without recompute:
    TRL's activation offloading with checkpointing off, which the note names (its real fields, checked here)."""
    from trl import SFTConfig
    from trl.models import get_act_offloading_ctx_manager

    export = to_accelerate(make_plan(dp_shard=2, checkpointing="full", offload_checkpoints=True))
    assert export.content["fsdp_config"]["fsdp_activation_checkpointing"] is False
    note = next(n for n in export.notes if n.startswith("activation offload"))
    assert "SFTConfig(activation_offloading=True, gradient_checkpointing=False)" in note
    assert "get_act_offloading_ctx_manager(model)" in note and callable(get_act_offloading_ctx_manager)
    config = SFTConfig(output_dir=str(tmp_path), activation_offloading=True, gradient_checkpointing=False,
                       report_to=[], use_cpu=True, bf16=False)  # CPU here; the fields are what the note names
    assert config.activation_offloading and not config.gradient_checkpointing
    plain = to_accelerate(make_plan(dp_shard=2, checkpointing="full"))
    assert plain.content["fsdp_config"]["fsdp_activation_checkpointing"] is True
    assert not any(n.startswith("activation offload") for n in plain.notes)


def _launch(plan, tmp_path, **env_extra: str) -> list[dict]:
    """`accelerate launch --config_file <the plan's export>` of the tiny script on 2 CPU ranks; each rank's report."""
    config = write_yaml(plan, tmp_path / "acc.yaml")
    env = dict(os.environ, **env_extra, TINY_SEQ=str(SEQ), TINY_OUT=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    env.pop("TINY_GRAD_ACCUM", None)
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
         "--main_process_port", str(free_port()), str(SCRIPT)],
        capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@needs_deepspeed
@pytest.mark.multiproc
def test_accelerate_launch_runs_the_exported_ulysses_yaml(tmp_path):
    """`accelerate launch --config_file <export>` on 2 CPU ranks: ALST gets the planned length and sdpa,
    gradient accumulation comes from the YAML (the script leaves Accelerator's at 1)."""
    results = _launch(make_plan(ulysses=2, zero_stage=3, grad_accum=2), tmp_path, DS_ACCELERATOR="cpu",
                      TINY_NO_SHM="1")
    for r in results:
        assert r["distributed_type"] == "DistributedType.DEEPSPEED" and r["world"] == 2 and r["sp"] == 2
        assert (r["sp_seq_length"], r["sp_seq_length_is_variable"]) == (SEQ, False)
        assert r["sp_attn_implementation"] == r["attn_implementation"] == "sdpa"
        assert r["grad_accum"] == 2
        assert all(loss == loss and loss > 0 for loss in r["losses"])
    assert results[0]["losses"] == results[1]["losses"]  # one sequence shared by the sp group: one loss


@pytest.mark.multiproc
def test_accelerate_launch_runs_the_exported_fsdp_yaml(tmp_path):
    """`accelerate launch --config_file <export>` of a dp_shard 2 plan on 2 CPU ranks: Accelerate's FSDP2
    shards every parameter over the 2 ranks (half the elements each), and two optimizer steps run in bf16
    mixed precision, each rank on its own rows."""
    results = _launch(make_plan(dp_shard=2, zero_stage=3), tmp_path, TINY_FSDP_ON_CPU="1")
    for r in results:
        assert r["distributed_type"] == "DistributedType.FSDP" and r["is_fsdp2"] and r["world"] == 2, r
        assert (r["dp_shard"], r["sp"], r["grad_accum"], r["mixed_precision"]) == (2, 1, 1, "bf16"), r
        assert r["sharded_params"] == r["params"] > 0 and r["local_numel"] * 2 == r["full_numel"], r
        assert r["updated"] == r["params"], r  # a step changed every parameter shard
        assert len(r["losses"]) == 2 and all(loss == loss and loss > 0 for loss in r["losses"])
    assert results[0]["losses"] != results[1]["losses"]  # data parallel: each rank trains on its own rows
