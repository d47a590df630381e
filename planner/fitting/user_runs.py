"""The user's own measured runs for ``sp-plan calibrate``: ``sp-plan validate --json`` reports and CSV files.

A validate report carries the configuration that ran (the plan), the topology its time prediction used
and every rank's measurements; its step time is the slowest rank's median timed step, and on GPUs its
peak memory is the largest ``max_memory_allocated`` over the ranks.

A CSV has one run per row. Columns (names as the CLI flags, with underscores):

- required: ``model`` (preset or config.json path), ``seq_len``, ``gpus``;
- hardware: ``topology`` (preset/file; default the ``gpu`` column's natural machine) or ``gpu``;
- layout: ``tp``, ``ulysses``, ``ring``, ``dp_shard``, ``dp_replicate``, ``pp``, ``ep``;
- options: ``micro_batch``, ``grad_accum``, ``dtype``, ``optimizer``, ``zero``, ``checkpointing``,
  ``offload_optimizer``, ``offload_params``, ``offload_checkpoints``, ``tiled_mlp``, ``tiled_loss``,
  ``fp8_linears``, ``compiled``, ``document_length``, ``attention_kernel``, ``tp_sequence_parallel``,
  ``pipeline_schedule``, ``virtual_stages``; ``stack`` (default: the command's ``--stack``);
- measurements, at least one: ``step_s``, ``tps_per_gpu``, ``peak_allocated_gib``, ``reserved_gib``,
  ``nvml_used_gib``; ``id`` names the row in reports.
"""

from __future__ import annotations

import csv
import io
import hashlib
import json
import math
import statistics
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sp_plan.cost_models import degrees as registry
from sp_plan.cost_models.atomic_io import atomic_write_text
from sp_plan.cost_models.errors import CostModelError, explain_validation_error
from sp_plan.cost_models.json_io import json_loads
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.model_spec import ModelSpec, load_model
from sp_plan.cost_models.topology import TopologySpec
from sp_plan.cost_models.topology.presets import NATURAL_NODE_PRESET, spec_to_yaml
from sp_plan.cost_models.train_spec import TrainSpec

from .runs import MeasuredRun

MAX_RUN_FILE_BYTES = 1 << 26
#: Most measurements one calibrate reads (all files together): each is predicted before and after the fit
#: (about 1 ms each), while the fit itself sees at most ``user_fit.MAX_FIT_RUNS`` of them.
MAX_RUNS = 10_000
_BOOL = ("offload_optimizer", "offload_params", "offload_checkpoints", "tiled_mlp", "tiled_loss", "fp8_linears",
         "compiled", "tp_sequence_parallel")
_INT = ("micro_batch", "grad_accum", "document_length", "virtual_stages")
_STR = ("dtype", "optimizer", "checkpointing", "attention_kernel", "pipeline_schedule")
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
        atomic_write_text(path, text)
    return str(path)


def runs_from_validate(data: dict[str, Any], origin: str, cache_dir: Path, stack: str) -> list[MeasuredRun]:
    """Measured runs in one ``sp-plan validate --json`` report: its step time, and peak memory on GPUs.

    The report is a user file: every section is checked for its type and every measurement for its
    bounds (:data:`MEASURE_BOUNDS`), and each problem is one line naming the file."""
    plan, topo = data.get("plan"), data.get("time_topology")
    if not isinstance(plan, dict) or not isinstance(topo, dict):
        raise CostModelError(f"{origin}: this validate report has no plan/time_topology section; re-run "
                             "`sp-plan validate --json` with this version of sp-plan")
    try:
        model = ModelSpec(**plan["model"])
        train = TrainSpec(**plan["train"])
        layout = Layout(**plan["layout"])
    except (ValidationError, KeyError, TypeError) as exc:
        raise CostModelError(f"{origin}: the report's plan is not a valid configuration ({exc})".splitlines()[0]) \
            from exc
    try:
        layout.check_against(model, train.seq_len, train.tp_sequence_parallel)
    except CostModelError as exc:
        raise CostModelError(f"{origin}: the report's plan is not a valid configuration ({exc})") from exc
    topology = _topology_file(topo, cache_dir)
    ranks = data.get("ranks") or []
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        raise CostModelError(f"{origin}: the report has no rank measurements")
    overrides = data.get("memory_overrides") or {}
    if not isinstance(overrides, dict):
        raise CostModelError(f"{origin}: memory_overrides must be a mapping")
    common = dict(source=origin, confidence="measured", model=model, train=train, layout=layout,
                  topology=topology, stack=plan.get("stack", stack),
                  memory_overrides=overrides, group="user runs")
    medians = []
    for rank, r in enumerate(ranks):
        steps = r.get("step_seconds")
        if not steps:
            continue
        if not isinstance(steps, list):
            raise CostModelError(f"{origin}: rank {rank}'s step_seconds must be a list of seconds")
        medians.append(statistics.median(measured_value(v, "step_s", f"{origin} rank {rank}") for v in steps))
    if not medians:
        raise CostModelError(f"{origin}: no rank has timed steps (step_seconds); run validate with --steps 2 or more")
    label = f"{Path(origin).name}: {model.name} {layout.describe()} {train.seq_len} tokens"
    runs = [MeasuredRun(id=f"{label} [step_s]", metric="step_s", value=max(medians), **common)]
    peaks = [measured_value(r["peak_allocated"], "peak_bytes", f"{origin} rank {rank}")
             for rank, r in enumerate(ranks) if r.get("peak_allocated")]
    if peaks:
        runs.append(MeasuredRun(id=f"{label} [peak]", metric="peak_bytes", value=float(max(peaks)),
                                **{**common, "group": None}))
    return runs


def _cell(row: dict[str, str], key: str) -> str | None:
    value = row.get(key)
    return value.strip() if value is not None and value.strip() != "" else None


def write_runs_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Measurements as the CSV :func:`runs_from_csv` reads (one column per key any row has), written
    atomically: what a script collecting runs from another framework, or a synthetic check, hands to
    ``sp-plan calibrate``."""
    fields = sorted({k for r in rows for k in r})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())


def runs_from_csv(path: Path, stack: str) -> list[MeasuredRun]:
    """One run per row (see the module docstring for the columns); every problem is one line naming the
    file and row."""
    runs: list[MeasuredRun] = []
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            fields = reader.fieldnames or ()
            missing = {"model", "seq_len", "gpus"} - set(fields)
            if missing:
                raise CostModelError(f"{path}: CSV needs the columns {', '.join(sorted(missing))} "
                                     "(plus layout, options and at least one measurement column)")
            for i, row in enumerate(reader, start=2):
                where = f"{path}:{i}"
                if len(runs) >= MAX_RUNS:
                    raise CostModelError(f"{where}: more than {MAX_RUNS} runs; calibrate on fewer (a few dozen "
                                         "layouts constrain every fitted parameter)")
                # DictReader pads a short row with None and files a long row's extra cells under None.
                if None in row or any(value is None for value in row.values()):
                    cells = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or ())
                    raise CostModelError(f"{where}: the row has {cells} cells but the header has {len(fields)} "
                                         "columns; fix the row (empty cells are fine, missing commas are not)")
                try:
                    runs.extend(_csv_row(row, where, stack, str(path)))
                except (ValueError, ValidationError) as exc:
                    if isinstance(exc, CostModelError):
                        raise
                    if isinstance(exc, ValidationError):
                        raise explain_validation_error(exc, f"run at {where}") from exc
                    raise CostModelError(f"{where}: {exc}".splitlines()[0]) from exc
    except UnicodeDecodeError as exc:
        raise CostModelError(f"{path} is not UTF-8 text (byte {exc.start}): save the CSV as UTF-8") from exc
    except csv.Error as exc:
        raise CostModelError(f"{path} is not a readable CSV: {exc}") from exc
    return runs


#: Physical bounds of a measured figure (unit of the CSV column): a value outside them is a typo or a unit
#: mix-up (milliseconds as seconds, bytes as GiB), not a measurement; fitting to it would drag every
#: parameter to its bound and print percentage errors of inf.
MEASURE_BOUNDS: dict[str, tuple[float, float, str]] = {
    "step_s": (1e-6, 1e6, "seconds per optimizer step (a microsecond to about 11 days)"),
    "tps_per_gpu": (1e-3, 1e8, "tokens per second per GPU"),
    "peak_allocated_gib": (1e-6, 1e4, "GiB per GPU"),
    "reserved_gib": (1e-6, 1e4, "GiB per GPU"),
    "nvml_used_gib": (1e-6, 1e4, "GiB per GPU"),
    "peak_bytes": (1.0, 1e4 * (1 << 30), "bytes per rank"),
}


def measured_value(text: object, column: str, where: str) -> float:
    """A measurement cell as a finite float inside :data:`MEASURE_BOUNDS`, or one error naming the cell."""
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CostModelError(f"{where}: {column} {text!r} is not a number") from None
    lo, hi, unit = MEASURE_BOUNDS[column]
    if not math.isfinite(value) or not lo <= value <= hi:
        raise CostModelError(f"{where}: {column} = {text} is outside {lo:g}..{hi:g} {unit}; give the measured "
                             "value in the column's unit")
    return value


def _csv_row(row: dict[str, str], where: str, stack: str, source: str) -> list[MeasuredRun]:
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
    degrees = {k: int(_cell(row, k)) for k in (*registry.innermost_first(), "ep") if _cell(row, k)}  # type: ignore[arg-type]
    layout = Layout.for_world(gpus, **degrees)
    topology = _cell(row, "topology") or NATURAL_NODE_PRESET.get(_cell(row, "gpu") or "h100-80gb")
    if topology is None:
        raise CostModelError(f"{where}: give a topology (preset or file) or a known gpu")
    label = _cell(row, "id") or f"{Path(where).name}: {model.name} {layout.describe()} {train.seq_len} tokens"
    # The source is the file, not the row: leave-one-file-out cross-validation holds out a file at a time
    # (one fit per file; per row it was one fit per row, quadratic in the rows); ids and errors keep the row.
    common = dict(source=source, confidence="measured", model=model, train=train, layout=layout, topology=topology,
                  stack=_cell(row, "stack") or stack)
    out = []
    for column, (metric, factor) in _MEASURES.items():
        if _cell(row, column):
            value = measured_value(_cell(row, column), column, where)
            out.append(MeasuredRun(id=f"{label} [{metric}]", metric=metric, value=value * factor,
                                   group="user runs" if metric in ("step_s", "tps_per_gpu") else None, **common))
    if not out:
        raise CostModelError(f"{where}: no measurement; give at least one of {', '.join(_MEASURES)}")
    return out


def load_runs(paths: list[Path], cache_dir: Path, stack: str) -> list[MeasuredRun]:
    """Measured runs from validate JSON reports and CSV files."""
    runs: list[MeasuredRun] = []
    for path in paths:
        if not path.is_file():
            raise CostModelError(f"{path} does not exist or is not a file: give a CSV or a validate --json report")
        if path.stat().st_size > MAX_RUN_FILE_BYTES:
            raise CostModelError(f"{path} is larger than {MAX_RUN_FILE_BYTES} bytes")
        if path.suffix.lower() == ".csv":
            runs.extend(runs_from_csv(path, stack))
            continue
        try:
            data = json_loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CostModelError(f"{path} is neither a CSV nor a validate JSON report: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise CostModelError(f"{path} is not UTF-8 text: give a CSV or a `sp-plan validate --json` report") \
                from exc
        except RecursionError as exc:
            raise CostModelError(f"{path} nests too deeply to be a validate report") from exc
        if not isinstance(data, dict):
            raise CostModelError(f"{path}: expected the JSON object `sp-plan validate --json` prints")
        runs.extend(runs_from_validate(data, str(path), cache_dir, stack))
    if len(runs) > MAX_RUNS:
        raise CostModelError(f"{len(runs)} measurements in {len(paths)} files; calibrate takes at most {MAX_RUNS} "
                             "(every one is predicted twice; a few hundred constrain every fitted parameter)")
    return runs


__all__ = ["load_runs", "runs_from_csv", "runs_from_validate", "write_runs_csv"]
