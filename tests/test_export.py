import json

import pytest
import yaml
from click.testing import CliRunner

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.cli.main import cli
from sp_plan.planner.errors import PlannerError
from sp_plan.planner.export import to_accelerate, to_deepspeed, to_torchrun
from sp_plan.planner.plan import Hardware, Plan, load_plan


def make_plan(gpus=8, per_node=8, **degrees):
    layout = Layout.for_world(gpus, **degrees)
    return Plan(
        model=get_model_preset("llama3-8b"),
        train=TrainSpec(seq_len=131072, zero_stage=3, offload_optimizer=True),
        layout=layout,
        hardware=Hardware(num_gpus=gpus, gpus_per_node=per_node, gpu="h100-80gb", topology="hgx-h100"),
    )


def test_plan_yaml_round_trip(tmp_path):
    plan = make_plan(ulysses=8)
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert load_plan(path) == plan


@pytest.mark.parametrize(
    "payload, message",
    [("[1, 2]", "must hold a mapping"), ("sp_plan_format: 99\n", "format 99"), (": : :", "not valid YAML")],
)
def test_bad_plan_files(tmp_path, payload, message):
    path = tmp_path / "plan.yaml"
    path.write_text(payload)
    with pytest.raises(PlannerError, match=message):
        load_plan(path)


def test_plan_with_unknown_key_rejected(tmp_path):
    data = yaml.safe_load(make_plan(ulysses=8).to_yaml())
    data["layout"]["ulyses"] = 8
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="layout.ulyses: unknown field"):
        load_plan(path)


def _accelerate_parallelism(config):
    """Build accelerate's own ParallelismConfig from the exported YAML section."""
    from accelerate.parallelism_config import ParallelismConfig

    prefix = "parallelism_config_"
    keys = {k[len(prefix):]: v for k, v in config["parallelism_config"].items()}
    handler_keys = {k for k in keys if k.startswith("sp_") and k not in ("sp_size", "sp_backend")} | {"cp_comm_strategy"}
    return ParallelismConfig(**{k: v for k, v in keys.items() if k not in handler_keys})


@pytest.mark.parametrize(
    "degrees, distributed_type",
    [({"ulysses": 8}, "DEEPSPEED"), ({"ring": 4}, "FSDP"), ({"tp": 2}, "FSDP"), ({"ulysses": 4}, "DEEPSPEED")],
)
def test_accelerate_yaml_loads_with_accelerate(tmp_path, degrees, distributed_type):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    plan = make_plan(**degrees)
    exported = to_accelerate(plan)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(exported.content))
    loaded = ClusterConfig.from_yaml_file(str(path))
    assert loaded.distributed_type.value == distributed_type
    assert loaded.num_processes == 8
    parallel = _accelerate_parallelism(exported.content)
    assert parallel.total_size == plan.layout.world
    assert parallel.sp_size == plan.layout.ulysses and parallel.cp_size == plan.layout.ring


def test_accelerate_refuses_usp_and_says_why():
    with pytest.raises(PlannerError, match="mutually exclusive.*--to torchrun"):
        to_accelerate(make_plan(ulysses=4, ring=2))


def test_deepspeed_json_fields():
    exported = to_deepspeed(make_plan(gpus=16, per_node=8, ulysses=8))
    cfg = exported.content
    assert cfg["sequence_parallel_size"] == 8
    # DeepSpeed builds a data x sequence mesh from data_parallel_size and shards ZeRO over data only;
    # train_batch_size is counted differently by the Trainer and DeepSpeed under SP: both left out.
    assert "data_parallel_size" not in cfg and "train_batch_size" not in cfg
    assert any("global batch: 2 sequences" in note for note in exported.notes)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    json.dumps(cfg)


def test_deepspeed_refuses_ring():
    with pytest.raises(PlannerError, match="no ring attention"):
        to_deepspeed(make_plan(ring=8))


def test_deepspeed_zero_config_validates_with_deepspeed_when_installed():
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    cfg = to_deepspeed(make_plan(ulysses=8)).content
    zero_config.DeepSpeedZeroConfig(**cfg["zero_optimization"])


def test_torchrun_command_single_and_multi_node():
    single = to_torchrun(make_plan(ulysses=8)).content
    assert single == "torchrun --standalone --nproc-per-node=8 -m sp_plan.cli train --plan plan.yaml"
    multi = to_torchrun(make_plan(gpus=16, per_node=8, ulysses=8, ring=2))
    assert "--nnodes=2" in multi.content and "--rdzv-endpoint=$MASTER_ADDR:29500" in multi.content
    assert multi.content.endswith(" -m sp_plan.cli train --plan plan.yaml") and multi.notes
    own = to_torchrun(make_plan(ulysses=8), "my plan.yaml", script="train.py").content
    assert own == "torchrun --standalone --nproc-per-node=8 train.py --plan 'my plan.yaml'"


def test_export_cli(tmp_path):
    plan_path = tmp_path / "plan.yaml"
    make_plan(ulysses=8).save(plan_path)
    runner = CliRunner()
    result = runner.invoke(cli, ["export", str(plan_path), "--to", "deepspeed"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sequence_parallel_size"] == 8
    out = tmp_path / "acc.yaml"
    result = runner.invoke(cli, ["export", str(plan_path), "--to", "accelerate", "--out", str(out)])
    assert result.exit_code == 0 and yaml.safe_load(out.read_text())["distributed_type"] == "DEEPSPEED"


@pytest.mark.parametrize("exporter, who", [(to_deepspeed, "DeepSpeed"), (to_accelerate, "Accelerate")])
def test_a_degree_the_launcher_cannot_run_is_refused_not_dropped(exporter, who):
    plan = make_plan(gpus=16, pp=2, ulysses=8)
    with pytest.raises(PlannerError, match=f"{who}.* cannot run pp=2 .*re-plan with --pp 1"):
        exporter(plan)
    assert "sp_plan.cli train --plan" in to_torchrun(plan).content  # sp-plan's runtime runs pipeline stages


@pytest.mark.parametrize("exporter, who", [(to_deepspeed, "DeepSpeed"), (to_accelerate, "Accelerate")])
def test_expert_parallelism_is_refused_where_the_launcher_has_none(exporter, who):
    """ep is no mesh degree (it regroups shard-group ranks), so it must be checked apart from the degrees: an
    exported config without it would train every expert on every rank."""
    base = make_plan(gpus=8, ulysses=8)
    plan = Plan(**{**dict(base), "model": get_model_preset("qwen3-30b-a3b"), "layout": Layout.for_world(8, ulysses=8, ep=4)})
    with pytest.raises(PlannerError, match=f"{who}.* cannot run ep=4 .*re-plan with --ep 1, or export --to megatron"):
        exporter(plan)


def test_the_cli_refuses_to_export_pipeline_stages_to_deepspeed(tmp_path):
    path = tmp_path / "plan.yaml"
    make_plan(gpus=16, pp=2, ulysses=8).save(path)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "sp_plan.cli", "export", str(path), "--to", "deepspeed"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "cannot run pp=2" in run.stderr and "Traceback" not in run.stderr
