"""Every miss of the accuracy targets, and the cause recorded for it.

A figure misses when it is printed exactly (confidence ``exact``) and its out-of-sample error is outside
its kind's target (step time within 15% under each held-out split; memory within 10%; max length within
15%); a published table misses when its held-out Kendall tau is below 0.8. Each miss must match one
entry of ``cost_models/data/calibration/misses.yaml``: what causes it, whether the cause is *established*
(read from the source's software or measured) or a *hypothesis*, and then what measurement would settle
it. ``benchmarks/accuracy.py`` prints them; a test fails on a miss without a cause and on a cause that
no longer matches any miss (a fix must retire its entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sp_plan.cost_models import data as shipped_data
from sp_plan.cost_models.yaml_io import safe_load

from .parameters import TIME_KINDS
from .report import TARGETS, TAU_TARGET, RunResult, step_time_error, table_orders

Split = Literal["source", "gpu-variant", "stack"]
ALL_SPLITS: tuple[Split, ...] = ("source", "gpu-variant", "stack")


class MissCause(BaseModel):
    """Why figures (whose id starts with ``match``) or a published table (named ``match``) miss."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Figure id prefixes (any of them), or a table's exact name.
    match: tuple[str, ...] = Field(min_length=1)
    #: The held-out splits the entry explains (time figures); memory and max-length figures have one.
    splits: tuple[Split, ...] = ALL_SPLITS
    established: bool
    cause: str = Field(min_length=20)
    #: What would settle a hypothesis (required when ``established`` is false).
    settles: str = ""
    #: The heading of docs/accuracy.md that holds the evidence.
    see: str = Field(min_length=1)

    @field_validator("match", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    @property
    def name(self) -> str:
        return " | ".join(self.match)

    @model_validator(mode="after")
    def _hypotheses_say_what_settles_them(self) -> MissCause:
        if not self.established and not self.settles:
            raise ValueError(f"{self.name!r}: a cause that is not established must say what would settle it")
        return self


class MissCauses(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    figures: tuple[MissCause, ...] = ()
    tables: tuple[MissCause, ...] = ()


@cache
def miss_causes() -> MissCauses:
    return MissCauses.model_validate(safe_load(shipped_data.read_text("calibration", "misses")))


@dataclass(frozen=True)
class Miss:
    """One figure under one split, or one table, outside its target."""

    name: str
    what: Literal["figure", "table"]
    kind: str
    split: Split
    #: The scored error (a step-time error for time figures) or the table's held-out tau.
    value: float


def find_misses(results: Sequence[RunResult], splits: dict[str, dict[str, dict[str, float]]]) -> list[Miss]:
    """The misses of the exact-confidence figures and of the published tables (see the module doc)."""
    misses: list[Miss] = []
    step_target = TARGETS["throughput"]
    for r in results:
        run = r.run
        if run.confidence != "exact":
            continue
        if run.kind in TIME_KINDS:
            errors: dict[Split, float | None] = {"source": r.held_out_error}
            for split in ("gpu-variant", "stack"):
                errors[split] = next((errs[run.id] for errs in splits.get(split, {}).values() if run.id in errs),
                                     None)
            for split, err in errors.items():
                if err is not None and abs(step_time_error(run, err)) > step_target:
                    misses.append(Miss(run.id, "figure", run.kind, split, step_time_error(run, err)))
        elif run.kind in TARGETS and abs(r.best_error) > TARGETS[run.kind]:
            misses.append(Miss(run.id, "figure", run.kind, "source", r.best_error))
    for t in table_orders(results):
        tau = t.tau_held_out if t.tau_held_out is not None else t.tau
        if tau < TAU_TARGET:
            misses.append(Miss(t.group, "table", "ordering", "source", tau))
    return misses


@dataclass(frozen=True)
class Explained:
    explained: list[tuple[Miss, MissCause]]
    unexplained: list[Miss]
    #: Causes that match no current miss (the miss they explained was fixed, or the entry is wrong).
    stale: list[MissCause]


def _cause_for(miss: Miss, causes: MissCauses) -> MissCause | None:
    """The first entry (in file order) that matches: a figure id prefix, or a table's exact name."""
    if miss.what == "table":
        return next((c for c in causes.tables if miss.name in c.match), None)
    return next((c for c in causes.figures if miss.name.startswith(c.match) and miss.split in c.splits), None)


def explain(misses: Sequence[Miss], causes: MissCauses | None = None) -> Explained:
    causes = causes or miss_causes()
    explained, unexplained, used = [], [], set()
    for m in misses:
        cause = _cause_for(m, causes)
        if cause is None:
            unexplained.append(m)
        else:
            explained.append((m, cause))
            used.add(id(cause))
    stale = [c for c in (*causes.figures, *causes.tables) if id(c) not in used]
    return Explained(explained, unexplained, stale)


def render_misses(result: Explained) -> list[str]:
    """The misses grouped by cause: each cause once, then each figure it explains with its error under every
    split it misses."""
    lines = [("misses of the targets and their causes (cost_models/data/calibration/misses.yaml; evidence in "
              "docs/accuracy.md)")]
    groups: dict[int, tuple[MissCause, dict[str, list[Miss]]]] = {}
    for m, c in result.explained:
        groups.setdefault(id(c), (c, {}))[1].setdefault(m.name, []).append(m)
    for cause, by_name in groups.values():
        status = "established" if cause.established else "hypothesis"
        lines.append(f"- [{status}] {cause.name}: {cause.cause}")
        if not cause.established:
            lines.append(f"    would settle it: {cause.settles}")
        lines.append(f"    evidence: docs/accuracy.md, '{cause.see}'")
        for name, ms in by_name.items():
            if ms[0].what == "table":
                lines.append(f"    {name[:80]:<80} tau {ms[0].value:+.2f} (held out)")
                continue
            scored = "step time, " if ms[0].kind in TIME_KINDS else ""
            errors = ", ".join(f"{m.split} {m.value:+.1%}" for m in ms)
            lines.append(f"    {name[:80]:<80} {scored}held out by {errors}")
    for m in result.unexplained:
        lines.append(f"- NO CAUSE RECORDED: {m.name} ({m.split}, {m.value:+.3f})")
    for c in result.stale:
        lines.append(f"- STALE CAUSE (matches no miss): {c.name}")
    missing = [m for m, _ in result.explained] + result.unexplained
    figures = {m.name for m in missing if m.what == "figure"}
    tables = {m.name for m in missing if m.what == "table"}
    hypotheses = {m.name for m, c in result.explained if not c.established}
    uncaused = {m.name for m in result.unexplained}
    lines.append(f"{len(figures)} exact figures and {len(tables)} tables miss under some split: "
                 f"{len((figures | tables) - hypotheses - uncaused)} explained by established causes only, "
                 f"{len(hypotheses)} by a hypothesis (with what would settle it), {len(uncaused)} without a cause")
    return lines


__all__ = ["ALL_SPLITS", "Explained", "Miss", "MissCause", "MissCauses", "explain", "find_misses", "miss_causes",
           "render_misses"]
