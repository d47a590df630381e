"""``sp-plan export PLAN --to accelerate|deepspeed|megatron|torchrun``."""

from __future__ import annotations


from pathlib import Path

import click
import yaml

from sp_plan.cli.autoconfig import load_config_file
from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.atomic_io import write_output

from sp_plan.planner.export import EXPORTERS, check_under_stack, to_torchrun
from sp_plan.planner.plan import Plan, load_plan
from sp_plan.planner.errors import PlannerError
from .common import check_output_path


@click.command("export")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--to", "target", type=click.Choice(sorted(EXPORTERS)), required=True,
              help="Launcher to export for: accelerate (YAML), deepspeed (JSON), megatron (Megatron-LM pretrain_gpt.py "
                   "arguments and launch line, as a bash script), torchrun (sp-plan's runtime).")
@click.option("--json", "as_json", is_flag=True,
              help="Write the export as JSON (megatron: the argument lists, environment and command).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None, help="Write here instead of stdout (- is stdout).")
@click.option("--script", default=None,
              help="Training script to launch instead of the installed `-m sp_plan.cli train` (torchrun only; it "
                   "must take --plan FILE).")
@click.option("--model", "model_config", type=click.Path(dir_okay=True), default=None, metavar="CONFIG.JSON",
              help="The config.json the plan was made from (or its folder), passed to `sp-plan train --model` "
                   "(torchrun only; required for mixture-of-experts and MLA plans, checked against the plan's model).")
@click.option("--stack", default=None, metavar="NAME|FILE",
              help="Stack to check the plan under. Default: hf-deepspeed for deepspeed and for accelerate with "
                   "Ulysses (DeepSpeed ALST), hf-fsdp2 for accelerate otherwise (FSDP2 + torch context "
                   "parallel), megatron-core for megatron; torchrun runs the plan's own stack and is not re-checked "
                   "unless asked.")
@click.option("--calibration", default=None, metavar="FILE",
              help="Calibration file for the check (default: the plan's own, when checked under its own stack).")
def command(plan_file: str, target: str, as_json: bool, out_file: str | None, script: str | None,
            model_config: str | None, stack: str | None, calibration: str | None) -> None:
    """Write PLAN_FILE (from `sp-plan plan --out`; - reads it from standard input) as a launcher config, after checking that the plan
    still fits under the stack that launcher runs (refused, with the re-plan command, when not). What the
    config cannot hold (the training script's part) is printed as notes on stderr; docs/exports.md."""
    check_output_path(out_file, "--out")
    if target == "torchrun" and plan_file == "-":
        raise PlannerError("--to torchrun writes a command that reads the plan file at launch: give the plan's "
                           "path instead of - (standard input)")
    if model_config is not None and target != "torchrun":
        raise PlannerError(f"--model is for --to torchrun (sp-plan train --model); the {target} export leaves the "
                           "model to the training script")
    plan = load_plan(plan_file)
    if model_config is not None:
        check_model_config(plan, model_config)
    if target == "torchrun":
        exported = to_torchrun(plan, plan_path=plan_file, script=script, model_config=model_config)
    elif target == "megatron":  # the stack it is checked under decides the loss flags
        exported = EXPORTERS[target](plan, stack)
    else:
        exported = EXPORTERS[target](plan)
    if target != "torchrun" or stack is not None or calibration is not None:
        exported.notes += check_under_stack(plan, target, stack, calibration)
    if as_json:
        data = exported.data if exported.data is not None else exported.content
        text = strict_dumps(data if isinstance(data, dict) else {"command": data}, indent=2) + "\n"
    elif isinstance(exported.content, str):
        text = exported.content + "\n"
    elif target == "deepspeed":
        text = strict_dumps(exported.content, indent=2) + "\n"
    else:
        text = yaml.safe_dump(exported.content, sort_keys=False)
    write_output(out_file or "-", text)
    if out_file not in (None, "-"):
        click.echo(f"wrote {target} config to {out_file}", err=True)
    for note in exported.notes:
        click.echo(f"note: {note}", err=True)


def check_model_config(plan: Plan, path: str) -> None:
    """Refuse a --model file that is not the plan's model: the exported command would train another one."""
    problem = plan.model.other_model_problem(load_config_file(Path(path).expanduser()), f"--model {path!r}")
    if problem:
        raise PlannerError(problem)
