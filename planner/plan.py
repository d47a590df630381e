"""The plan file: what the planner recommends and what the runtime loads.

A plan pins everything needed to reproduce the run: the full model architecture (so a plan made
from a local config.json works on a machine without that file), the training options, the layout,
the hardware it was planned for, and the prediction it was chosen on. YAML on disk, validated on
load; unknown keys are rejected so a typo never silently falls back to a default.

A plan file cut short (an interrupted copy, a full disk on an old version that wrote in place) must not
load as a smaller plan: every file ends with ``end_of_plan: true``, which :func:`load_plan` requires, and
a plan must be internally consistent (its GPU count is its layout's world size, a node holds no more
GPUs than the plan uses, the estimate has its sections), so a hand edit that changes one without the other is refused instead of
launching a run of the wrong size. The marker is a last key rather than a checksum so plans stay
editable by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sp_plan.cost_models.atomic_io import atomic_write_text
from sp_plan.cost_models.errors import explain_validation_error
from sp_plan.cost_models.layout import Layout, expert_parallel_invalid
from sp_plan.cost_models.memory.assumptions import MemoryAssumptions
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.stack import DEFAULT_STACK
from sp_plan.cost_models.train_spec import TrainSpec

from .errors import PlannerError
from sp_plan.cost_models.yaml_io import read_small_text, safe_load

PLAN_FORMAT_VERSION = 1
#: Plans are a few KB; refuse anything large before parsing it.
_MAX_PLAN_BYTES = 4 << 20
#: The last key of every plan file; its absence means the file was cut short.
END_MARKER = "end_of_plan"
#: Sections a recorded estimate must have (what export's notes and validate's comparison read).
ESTIMATE_SECTIONS = ("memory", "fits", "time")


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
    #: Memory-assumption overrides the prediction was made with (``--assume KEY=VALUE``, e.g.
    #: ``cross_entropy_implementation: megatron_fused``): re-applied when the plan is re-checked or exported
    #: (the Megatron export writes the fused cross-entropy flags from it). Omitted from the file when empty.
    assume: dict[str, Any] = Field(default_factory=dict, max_length=len(MemoryAssumptions.model_fields))
    #: Completeness marker: declared last so it is the file's last line (see the module docstring).
    end_of_plan: Literal[True] = True

    @field_validator("assume")
    @classmethod
    def _known_assumptions(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(MemoryAssumptions.model_fields))
        if unknown:
            raise ValueError(f"unknown memory assumptions {unknown}; known: {', '.join(MemoryAssumptions.model_fields)}")
        checked = MemoryAssumptions(**value)  # each value validated as --assume validates it
        return {key: getattr(checked, key) for key in value}

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        """Refuse plans whose parts disagree: each part alone is valid, together they describe no run."""
        world, hw = self.layout.world, self.hardware
        if hw.num_gpus != world:
            raise ValueError(
                f"hardware.num_gpus is {hw.num_gpus} but the layout ({self.layout.describe()}) uses {world} GPUs; "
                "the file was edited or cut: re-run `sp-plan plan ... --out` for the cluster you mean")
        if hw.gpus_per_node > hw.num_gpus:
            raise ValueError(f"hardware.gpus_per_node {hw.gpus_per_node} exceeds num_gpus {hw.num_gpus}")
        experts = expert_parallel_invalid(self.model, self.layout.ep, self.layout.shard_group)
        if experts:
            raise ValueError(f"layout: {experts}")
        if self.estimate:
            missing = [k for k in ESTIMATE_SECTIONS if k not in self.estimate]
            if missing:
                raise ValueError(f"the estimate lacks {', '.join(missing)} (the file is incomplete); "
                                 "re-run `sp-plan plan ... --out`")
        return self

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        if not data["assume"]:
            del data["assume"]  # plans without overrides read as before
        return yaml.safe_dump(data, sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Write the plan whole or not at all (a crash mid-write leaves the previous file, never half)."""
        atomic_write_text(path, self.to_yaml(), error=PlannerError)


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file written by ``sp-plan plan --out``."""
    file = Path(path).expanduser()
    name = "the plan on standard input" if str(path) == "-" else str(file)
    text = read_small_text(file, _MAX_PLAN_BYTES, "plan file",
                           "not found: create one with `sp-plan plan ... --out plan.yaml`", PlannerError)
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        raise PlannerError(f"{name} is not valid YAML: {exc}".splitlines()[0]) from exc
    return plan_from_dict(data, name, require_end=True)


def plan_from_dict(data: Any, source: str = "plan", *, require_end: bool = False) -> Plan:
    """A validated plan from parsed data. ``require_end``: the data came from a file, which must carry the
    completeness marker (a dict handed over in memory, e.g. from a checkpoint, cannot be cut short)."""
    if not isinstance(data, dict):
        raise PlannerError(f"{source} must hold a mapping with model, train, layout and hardware")
    version = data.get("sp_plan_format", PLAN_FORMAT_VERSION)
    if version != PLAN_FORMAT_VERSION:
        raise PlannerError(
            f"{source} has plan format {version}; this sp-plan reads format {PLAN_FORMAT_VERSION}: re-run `sp-plan plan`"
        )
    if require_end and data.get(END_MARKER) is not True:
        raise PlannerError(
            f"{source} does not end with `{END_MARKER}: true`: the file was cut short (an interrupted write or "
            "copy) or predates the marker; write it again with `sp-plan plan ... --out`")
    try:
        return Plan(**data)
    except ValidationError as exc:
        raise explain_validation_error(exc, source) from exc


def plan_from_ranked(ranked: Any, model: ModelSpec, topology: Any, world: int,
                     explanation: list[str] | None = None, *, stack: str = DEFAULT_STACK,
                     calibration: str | None = None, assume: dict[str, Any] | None = None) -> Plan:
    """A plan file for one of the search's ranked plans (``sp_plan.planner.search.RankedPlan``), recording the
    stack, calibration and memory-assumption overrides it was predicted under (``SearchResult.stack`` /
    ``.calibration``, ``PlanSettings.assume``)."""
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
        assume=dict(assume or {}),
    )
