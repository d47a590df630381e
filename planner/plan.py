"""The plan file: what the planner recommends and what the runtime loads.

A plan pins everything needed to reproduce the run: the full model architecture (so a plan made
from a local config.json works on a machine without that file), the training options, the layout,
the hardware it was planned for, and the prediction it was chosen on. YAML on disk, validated on
load; unknown keys are rejected so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cost_models.errors import explain_validation_error
from cost_models.layout import Layout
from cost_models.model_spec import ModelSpec
from cost_models.stack import DEFAULT_STACK
from cost_models.train_spec import TrainSpec

from .errors import PlannerError
from cost_models.yaml_io import read_small_text, safe_load

PLAN_FORMAT_VERSION = 1
#: Plans are a few KB; refuse anything large before parsing it.
_MAX_PLAN_BYTES = 4 << 20


class Hardware(BaseModel):
    """The cluster a plan was made for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_gpus: int = Field(ge=1, le=1 << 20)
    gpus_per_node: int = Field(ge=1, le=1 << 10)
    gpu: str
    topology: str = Field(description="Preset name or file the plan was evaluated on.")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sp_plan_format: int = PLAN_FORMAT_VERSION
    model: ModelSpec
    train: TrainSpec
    layout: Layout
    hardware: Hardware
    #: The estimate (memory, comm, time) the plan was ranked on, as JSON; informative for the runtime.
    estimate: dict[str, Any] = Field(default_factory=dict)
    #: Where each mesh dimension's groups land on the topology.
    placement: dict[str, Any] = Field(default_factory=dict)
    explanation: list[str] = Field(default_factory=list)
    #: The software stack the plan was made for: a shipped profile's name or a stack file's path
    #: (``--stack``); plans written before stacks existed were made for this runtime, ``sp-plan``.
    stack: str = Field(default=DEFAULT_STACK, min_length=1, max_length=4096)
    #: The calibration file the prediction used (``--calibration``), or None.
    calibration: str | None = Field(default=None, max_length=4096)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file written by ``sp-plan plan --out``."""
    file = Path(path).expanduser()
    text = read_small_text(file, _MAX_PLAN_BYTES, "plan file",
                           "not found: create one with `sp-plan plan ... --out plan.yaml`", PlannerError)
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        raise PlannerError(f"{file} is not valid YAML: {exc}".splitlines()[0]) from exc
    return plan_from_dict(data, str(file))


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise PlannerError(f"{source} must hold a mapping with model, train, layout and hardware")
    version = data.get("sp_plan_format", PLAN_FORMAT_VERSION)
    if version != PLAN_FORMAT_VERSION:
        raise PlannerError(
            f"{source} has plan format {version}; this sp-plan reads format {PLAN_FORMAT_VERSION}: re-run `sp-plan plan`"
        )
    try:
        return Plan(**data)
    except ValidationError as exc:
        raise explain_validation_error(exc, source) from exc


def plan_from_ranked(ranked: Any, model: ModelSpec, topology: Any, world: int,
                     explanation: list[str] | None = None, *, stack: str = DEFAULT_STACK,
                     calibration: str | None = None) -> Plan:
    """A plan file for one of the search's ranked plans (``planner.search.RankedPlan``), recording the
    stack and calibration it was predicted under (``SearchResult.stack`` / ``.calibration``)."""
    est = ranked.estimate.to_json_dict()
    return Plan(
        model=model,
        train=ranked.train,
        layout=ranked.layout,
        hardware=Hardware(num_gpus=world, gpus_per_node=min(topology.gpus_per_node, world), gpu=topology.gpu.name,
                          topology=topology.name),
        estimate={k: est[k] for k in ("memory", "host_memory", "fits", "comm", "time")},
        placement=est.get("placement") or {},
        explanation=explanation or [],
        stack=stack,
        calibration=calibration,
    )
