"""``sp-plan validate``: run a few steps of a plan and print measured vs predicted, per rank.

The plan comes from ``--plan plan.yaml`` or from the same flags as ``sp-plan estimate``. Under
torchrun the command measures in place (rank 0 prints); otherwise it launches the plan's ranks itself
(``torch.distributed.run --standalone``; gloo on CPU, NCCL on GPUs) and prints their report. torch is
imported only when the command runs, so ``sp-plan --help`` stays torch-free.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from sp_plan.cost_models.json_io import finite_or_null, strict_dumps
from sp_plan.cost_models.topology.spec import MAX_GPUS_PER_NODE
from sp_plan.cost_models.atomic_io import atomic_write_text
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.json_io import json_loads

from .common import (
    PIPELINE_OPTIONS,
    build_layout,
    build_model,
    build_topology,
    build_train,
    check_pipeline_flags_need_pp,
    layout_options,
    memory_technique_options,
    split_options,
)

#: The model families validate runs (registered adapter names): the runtime's Llama, or with --hf a
#: transformers model of the plan's shape.
DEFAULT_FAMILY = "llama"
HF_FAMILY = "hf"
#: Wall-clock bound for the launched ranks (start-up, planning of nothing, a few steps).
LAUNCH_TIMEOUT_S = 1800


def _plan_from_flags(model_name: str | None, gpus: int | None, gpus_per_node: int | None, gpu_name: str,
                     topology_ref: str | None, layers: int | None, options: dict[str, Any]):
    from sp_plan.cost_models.estimate import estimate
    from sp_plan.planner.plan import Hardware, Plan

    if not model_name or options.get("seq_len") is None or gpus is None:
        raise click.UsageError("give --plan FILE, or --model, --seq-len and --gpus (plus layout flags)")
    train_kwargs, layout_kwargs = split_options(options)
    model = build_model(model_name)
    if layers is not None:
        model = model.model_copy(update={"num_layers": layers})
    train = build_train(**train_kwargs)
    topology = build_topology(gpus, gpus_per_node, gpu_name, topology_ref)
    layout = build_layout(gpus, **layout_kwargs)
    check_pipeline_flags_need_pp(layout.pp, options.get("pipeline_schedule"), options.get("virtual_stages", 1))
    est = estimate(model, train, layout, topology)
    hardware = Hardware(num_gpus=gpus, gpus_per_node=min(topology.gpus_per_node, gpus), gpu=topology.gpu.name,
                        topology=topology_ref or topology.name)
    return Plan(model=model, train=train, layout=layout, hardware=hardware, estimate=est.to_json_dict(),
                explanation=["layout and options given on the command line"])


def pipeline_options(func):
    """--schedule, --virtual-stages and --stage-layers: the pipelined plan to run, as ``sp-plan estimate`` takes them."""
    for option in reversed(PIPELINE_OPTIONS):
        func = option(func)
    return func


def check_host_memory(plan, local_ranks: int, available: int | None = None, family: str = "llama") -> None:
    """Refuse, with the arithmetic and the way out, a run whose ranks cannot even build the model: each
    local rank materializes the whole model (random fp32 weights) before FSDP shards it, and a rank the
    kernel kills for memory leaves only a bare SIGKILL behind."""
    from sp_plan.cost_models.memory import memory_core
    from sp_plan.runtime.capabilities import memory_assumptions
    from sp_plan.runtime.host_ram import INIT_BYTES_PER_PARAM, available_host_bytes

    available = available_host_bytes() if available is None else available
    if available is None:
        return
    init = plan.model.num_params * INIT_BYTES_PER_PARAM
    core = memory_core(plan.model, plan.train, plan.layout, memory_assumptions(family))
    step = core.peak_allocated + core.host_total  # what the memory model predicts a rank holds in a step
    per_rank = max(init, step)
    need = per_rank * local_ranks
    if need > available:
        raise CostModelError(
            f"{local_ranks} rank(s) of this run need about {need / 1e9:.1f} GB of host RAM and "
            f"{available / 1e9:.1f} GB is available: each rank builds the whole {plan.model.name} "
            f"({plan.model.num_params / 1e9:.2f}B parameters, {init / 1e9:.1f} GB in fp32) before sharding it, "
            f"and the memory model predicts {step / 1e9:.1f} GB per rank during a step; run fewer layers with "
            "--layers N (the per-layer figures it checks do not change), a shorter --seq-len, or a smaller "
            "config.json")


def _launch(plan_path: Path, world: int, steps: int, time_topology: str | None, hf: bool) -> dict:
    """Run the ranks under torch.distributed.run and return rank 0's report (JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "sp_plan.cli", "validate", "--plan", str(plan_path), "--steps", str(steps),
               "--result-file", str(result)]
        if time_topology:
            cmd += ["--time-topology", time_topology]
        if hf:
            cmd.append("--hf")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        if done.returncode != 0 or not result.exists():
            lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "error:" in ln or "Error" in ln]
            # The error lines, then the output's last lines: a rank that exits without an exception (a
            # signal, an abort) leaves only torchrun's own ChildFailedError among the error lines.
            shown = errors[-12:] + [ln for ln in lines[-8:] if ln not in errors[-12:]]
            tail = "\n".join(shown or lines[-12:])
            killed = "SIGKILL" in done.stdout + done.stderr
            hint = " A rank was killed (SIGKILL): usually the host ran out of memory; try --layers N." if killed else ""
            raise CostModelError(f"the validation ranks failed (exit {done.returncode}).{hint}\n{tail}")
        return json_loads(result.read_text())


@click.command("validate")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Plan file (sp-plan plan --out); otherwise describe the run with the flags below.")
@click.option("--model", "model_name", default=None, help="Preset name or path to a HF config.json.")
@click.option("--seq-len", default=None, help="Tokens per sequence: 4096, 8K, ...")
@click.option("--micro-batch", type=click.IntRange(1, 1 << 16), default=1, show_default=True)
@click.option("--grad-accum", type=click.IntRange(1, 1 << 16), default=1, show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--optimizer", type=click.Choice(["adamw", "adamw_bf16"]), default="adamw", show_default=True)
@click.option("--zero", "zero_stage", type=click.IntRange(0, 3), default=3, show_default=True)
@memory_technique_options
@pipeline_options
@click.option("--gpus", type=click.IntRange(1, 1 << 20), default=None, help="Ranks to run (the plan's world).")
@click.option("--gpus-per-node", type=click.IntRange(1, MAX_GPUS_PER_NODE), default=None)
@click.option("--gpu", "gpu_name", default="h100-80gb", show_default=True, help="GPU preset (planning only).")
@click.option("--topology", "topology_ref", default=None, help="Topology preset or file the plan is for.")
@layout_options
@click.option("--layers", type=click.IntRange(1, 10_000), default=None,
              help="Run the model with this many layers (per-layer figures are unchanged; whole-model ones scale).")
@click.option("--steps", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Optimizer steps: the first is measured for bytes, the rest are timed.")
@click.option("--time-topology", default=None,
              help="Topology for the step-time prediction (default: the plan's on GPUs, a quick probe on CPU).")
@click.option("--hf", is_flag=True,
              help="Run a Hugging Face transformers model of the plan's shape (needs the [hf] extra) instead of "
                   "the runtime's Llama; predicted with the HF memory assumptions.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (bytes, seconds).")
@click.option("--result-file", type=click.Path(dir_okay=False, path_type=Path), default=None, hidden=True)
def command(plan_path: Path | None, model_name: str | None, seq_len: str | None, gpus: int | None,
            gpus_per_node: int | None, gpu_name: str, topology_ref: str | None, layers: int | None, steps: int,
            time_topology: str | None, hf: bool, as_json: bool, result_file: Path | None, **options: Any) -> None:
    """Run a few steps of the planned configuration and compare with the cost models, per rank:
    activation bytes saved for backward, communication bytes by collective, peak memory (CUDA) and
    step time; a pipelined plan (--pp) runs through its pipeline schedule and is compared stage by stage
    (parameters, gradients, optimizer states, activations in flight, P2P bytes). On a CPU-only machine the
    ranks are CPU processes over gloo."""
    from sp_plan.cost_models.units import parse_seq_len
    from sp_plan.planner.plan import load_plan
    from sp_plan.runtime.capabilities import unsupported_reasons

    if plan_path is not None:
        plan = load_plan(plan_path)
        if layers is not None:
            plan = plan.model_copy(update={"model": plan.model.model_copy(update={"num_layers": layers})})
    else:
        if seq_len is not None:
            options["seq_len"] = parse_seq_len(seq_len)
        plan = _plan_from_flags(model_name, gpus, gpus_per_node, gpu_name, topology_ref, layers, options)
    family = HF_FAMILY if hf else DEFAULT_FAMILY  # a registered model adapter's name
    reasons = unsupported_reasons(plan, family)
    if reasons:
        raise CostModelError("the runtime cannot execute this plan: " + " | ".join(reasons))
    world = plan.layout.world
    if "WORLD_SIZE" not in os.environ:  # the launcher checks once for all the ranks it will start
        check_host_memory(plan, world, family=family)
    if "WORLD_SIZE" in os.environ or world == 1:
        _run_here(plan, steps, time_topology, as_json, result_file, family)
        if "WORLD_SIZE" in os.environ:  # a launched rank: its report is written
            from sp_plan.runtime.auto import finish_worker

            finish_worker()
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        plan.save(path)
        click.echo(f"launching {world} rank(s) for {plan.layout.describe()} ...", err=True)
        report = _launch(path, world, steps, time_topology, hf)
    _emit(report, as_json)


def _run_here(plan, steps: int, time_topology: str | None, as_json: bool, result_file: Path | None,
              family: str = "llama") -> None:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise CostModelError(f"sp-plan validate needs torch ({exc.name} is missing): pip install 'sp-plan[runtime]'")
    import torch.distributed as dist

    from sp_plan.runtime.validate import run_validation

    try:
        report = run_validation(plan, steps=steps, topology=time_topology, family=family)
        if report is not None:
            data = report.to_json_dict()
            if result_file is not None:
                atomic_write_text(result_file, strict_dumps(finite_or_null(data)))
            else:
                _emit(data, as_json)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _emit(report: dict, as_json: bool) -> None:
    if as_json:
        click.echo(strict_dumps(finite_or_null(report), indent=2))
        return
    from sp_plan.runtime.validate import render

    click.echo(render(report))
