"""The user's own measured runs for ``sp-plan calibrate``: ``sp-plan validate --json`` reports and CSV files.

A validate report carries the configuration that ran (the plan), the topology its time prediction used
and every rank's measurements; its step time is the slowest rank's median timed step, and on GPUs its
peak memory is the largest ``max_memory_allocated`` over the ranks.

A CSV has one run per row. Columns (names as the CLI flags, with underscores):

- required: ``model`` (preset or config.json path), ``seq_len``, ``gpus``;
- hardware: ``topology`` (preset/file; default the ``gpu`` column's natural machine) or ``gpu``;
- layout: ``tp``, ``ulysses``, ``ring``, ``dp_shard``, ``dp_replicate``;
- options: ``micro_batch``, ``grad_accum``, ``dtype``, ``optimizer``, ``zero``, ``checkpointing``,
  ``offload_optimizer``, ``offload_params``, ``offload_checkpoints``, ``tiled_mlp``, ``tiled_loss``,
  ``fp8_linears``, ``compiled``, ``document_length``; ``stack`` (default: the command's ``--stack``);
- measurements, at least one: ``step_s``, ``tps_per_gpu``, ``peak_allocated_gib``, ``reserved_gib``,
  ``nvml_used_gib``; ``id`` names the row in reports.
"""

from __future__ import annotations

import csv
import hashlib
import json
import statistics
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cost_models.errors import CostModelError, explain_validation_error
from cost_models.layout import Layout
from cost_models.model_spec import ModelSpec, load_model
from cost_models.topology import TopologySpec
from cost_models.topology.presets import NATURAL_NODE_PRESET, spec_to_yaml
from cost_models.train_spec import TrainSpec

from .runs import MeasuredRun

MAX_RUN_FILE_BYTES = 1 << 26
MAX_RUNS = 10_000
_LAYOUT = ("tp", "ulysses", "ring", "dp_shard", "dp_replicate")
_BOOL = ("offload_optimizer", "offload_params", "offload_checkpoints", "tiled_mlp", "tiled_loss", "fp8_linears",
         "compiled")
_INT = ("micro_batch", "grad_accum", "document_length")
_STR = ("dtype", "optimizer", "checkpointing")
#: CSV measurement column -> MeasuredRun metric (and the factor to its unit).
_MEASURES = {"step_s": ("step_s", 1.0), "tps_per_gpu": ("tps_per_gpu", 1.0),
             "peak_allocated_gib": ("allocated_gib", 1.0), "reserved_gib": ("reserved_gib", 1.0),
             "nvml_used_gib": ("nvml_used_gib", 1.0)}


def _topology_file(spec: dict[str, Any], cache_dir: Path) -> str:
    """Write an inline topology (a validate report's) to a file the cost model can load; named by content."""
    try:
        parsed = TopologySpec(**spec)
    except ValidationError as exc:
        raise explain_validation_error(exc, "the report's time_topology") from exc
    text = spec_to_yaml(parsed)
    path = cache_dir / f"topology-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    if not path.exists():
        path.write_text(text)
    return str(path)


def runs_from_validate(data: dict[str, Any], origin: str, cache_dir: Path, stack: str) -> list[MeasuredRun]:
    """Measured runs in one ``sp-plan validate --json`` report: its step time, and peak memory on GPUs."""
    if not data.get("plan") or not data.get("time_topology"):
        raise CostModelError(f"{origin}: this validate report has no plan/time_topology section; re-run "
                             "`sp-plan validate --json` with this version of sp-plan")
    plan = data["plan"]
    try:
        model = ModelSpec(**plan["model"])
        train = TrainSpec(**plan["train"])
        layout = Layout(**plan["layout"])
    except (ValidationError, KeyError) as exc:
        raise CostModelError(f"{origin}: the report's plan is not a valid configuration ({exc})".splitlines()[0]) \
            from exc
    topology = _topology_file(data["time_topology"], cache_dir)
    ranks = data.get("ranks") or []
    if not ranks:
        raise CostModelError(f"{origin}: the report has no rank measurements")
    common = dict(source=origin, confidence="measured", model=model, train=train, layout=layout,
                  topology=topology, stack=plan.get("stack", stack),
                  memory_overrides=data.get("memory_overrides", {}), group="user runs")
    step = max(statistics.median(r["step_seconds"]) for r in ranks if r.get("step_seconds"))
    label = f"{Path(origin).name}: {model.name} {layout.describe()} {train.seq_len} tokens"
    runs = [MeasuredRun(id=f"{label} [step_s]", metric="step_s", value=step, **common)]
    peaks = [r.get("peak_allocated") for r in ranks if r.get("peak_allocated")]
    if peaks:
        runs.append(MeasuredRun(id=f"{label} [peak]", metric="peak_bytes", value=float(max(peaks)),
                                **{**common, "group": None}))
    return runs


def _cell(row: dict[str, str], key: str) -> str | None:
    value = row.get(key)
    return value.strip() if value is not None and value.strip() != "" else None


def runs_from_csv(path: Path, stack: str) -> list[MeasuredRun]:
    """One run per row (see the module docstring for the columns)."""
    runs: list[MeasuredRun] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"model", "seq_len", "gpus"} - set(reader.fieldnames or ())
        if missing:
            raise CostModelError(f"{path}: CSV needs the columns {', '.join(sorted(missing))} "
                                 "(plus layout, options and at least one measurement column)")
        for i, row in enumerate(reader, start=2):
            if len(runs) > MAX_RUNS:
                raise CostModelError(f"{path}: more than {MAX_RUNS} runs")
            where = f"{path}:{i}"
            try:
                runs.extend(_csv_row(row, where, stack))
            except (ValueError, ValidationError) as exc:
                if isinstance(exc, CostModelError):
                    raise
                raise CostModelError(f"{where}: {exc}".splitlines()[0]) from exc
    return runs


def _csv_row(row: dict[str, str], where: str, stack: str) -> list[MeasuredRun]:
    model = load_model(row["model"].strip())
    gpus = int(row["gpus"])
    train_kw: dict[str, Any] = {"seq_len": row["seq_len"].strip()}
    for key in _INT:
        if _cell(row, key):
            train_kw[key] = int(_cell(row, key))  # type: ignore[arg-type]
    for key in _STR:
        if _cell(row, key):
            train_kw[key] = _cell(row, key)
    for key in _BOOL:
        if _cell(row, key):
            train_kw[key] = _cell(row, key).lower() in ("1", "true", "yes", "y")  # type: ignore[union-attr]
    if _cell(row, "zero"):
        train_kw["zero_stage"] = int(_cell(row, "zero"))  # type: ignore[arg-type]
    train = TrainSpec(**train_kw)
    degrees = {k: int(_cell(row, k)) for k in _LAYOUT if _cell(row, k)}  # type: ignore[arg-type]
    layout = Layout.for_world(gpus, **degrees)
    topology = _cell(row, "topology") or NATURAL_NODE_PRESET.get(_cell(row, "gpu") or "h100-80gb")
    if topology is None:
        raise CostModelError(f"{where}: give a topology (preset or file) or a known gpu")
    label = _cell(row, "id") or f"{Path(where).name}: {model.name} {layout.describe()} {train.seq_len} tokens"
    common = dict(source=where, confidence="measured", model=model, train=train, layout=layout, topology=topology,
                  stack=_cell(row, "stack") or stack)
    out = []
    for column, (metric, factor) in _MEASURES.items():
        if _cell(row, column):
            out.append(MeasuredRun(id=f"{label} [{metric}]", metric=metric, value=float(_cell(row, column)) * factor,
                                   group="user runs" if metric in ("step_s", "tps_per_gpu") else None, **common))
    if not out:
        raise CostModelError(f"{where}: no measurement; give at least one of {', '.join(_MEASURES)}")
    return out


def load_runs(paths: list[Path], cache_dir: Path, stack: str) -> list[MeasuredRun]:
    """Measured runs from validate JSON reports and CSV files."""
    runs: list[MeasuredRun] = []
    for path in paths:
        if not path.is_file():
            raise CostModelError(f"{path} does not exist")
        if path.stat().st_size > MAX_RUN_FILE_BYTES:
            raise CostModelError(f"{path} is larger than {MAX_RUN_FILE_BYTES} bytes")
        if path.suffix.lower() == ".csv":
            runs.extend(runs_from_csv(path, stack))
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CostModelError(f"{path} is neither a CSV nor a validate JSON report: {exc}") from exc
        if not isinstance(data, dict):
            raise CostModelError(f"{path}: expected the JSON object `sp-plan validate --json` prints")
        runs.extend(runs_from_validate(data, str(path), cache_dir, stack))
    return runs


__all__ = ["load_runs", "runs_from_csv", "runs_from_validate"]
