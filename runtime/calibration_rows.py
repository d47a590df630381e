"""Rows for ``sp-plan calibrate`` from the runs users already make (torch-free).

:class:`CalibrationRecorder` collects a training run's per-step measurements (step time, tokens/s per GPU,
peak memory) beside the prediction of the plan that ran, and at the end appends one row, the run's steady
steps summarised, to a CSV in the format :mod:`sp_plan.planner.fitting.user_runs` reads: the configuration
columns (model, sequence length, GPUs, topology, layout degrees, options, stack) and the measurements
(``step_s``: the median steady step; ``tps_per_gpu``; ``peak_allocated_gib`` / ``reserved_gib`` where CUDA
measured them, empty on CPU). Two things feed it: the transformers/TRL callback
(:mod:`sp_plan.runtime.integrations.calibration_callback`) and the runtime's own
:class:`~sp_plan.runtime.trainer.Trainer` (``calibration_csv=``, ``sp-plan train --record-calibration``).

What the row names must be loadable by ``calibrate`` on its own, so files the run had only in memory are
written beside the CSV, in ``<csv stem>-files/`` (named by content): the model's ``config.json`` when it is
no shipped preset (the HF model's own config, or a Llama/Qwen config of the plan's ModelSpec), and the
topology when it is no shipped preset (the probed one, or a snapshot of the file given). The row is checked
when the recorder is made, before training: it is read back the way ``calibrate`` reads it, and a plan it
cannot describe is refused in one line. Only the recording rank (global rank 0) writes; the file is
rewritten whole (header merged, old rows kept) under an advisory lock, so a crash never leaves half a row
and two runs appending at once both land.

tokens/s per GPU is the planned tokens of a step (sequence length x micro-batch x accumulation x data
parallel, padding included: the token count the cost model's prediction divides by) over the median step
time and the GPUs; ``valid_tps_per_gpu`` (information only) counts the tokens that carried a label.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import hashlib
import io
import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sp_plan.cost_models.atomic_io import atomic_write_text
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.units import GiB
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.log import ensure_logging, get_logger

LOG = get_logger(__name__)

#: Steps of each run left out of its summary: the first includes lazy initialisation (allocator growth,
#: communicator set-up, the optimizer's state), the second often the rest (autotuning, lazy groups).
DEFAULT_WARMUP_STEPS = 2
#: The columns a recorded row carries, in this order: what ``calibrate`` reads, then what it ignores
#: (kept for the reader of the file: the framework, the steps timed, the plan's prediction).
CONFIG_COLUMNS = ("model", "seq_len", "gpus", "topology", "gpu", "tp", "ulysses", "ring", "dp_shard", "dp_replicate",
                  "pp", "ep", "micro_batch", "grad_accum", "dtype", "optimizer", "zero", "checkpointing",
                  "offload_optimizer", "offload_params", "offload_checkpoints", "tiled_mlp", "tiled_loss",
                  "fp8_linears", "compiled", "document_length", "attention_kernel", "tp_sequence_parallel",
                  "pipeline_schedule", "virtual_stages", "stack")
MEASURE_COLUMNS = ("step_s", "tps_per_gpu", "peak_allocated_gib", "reserved_gib", "id")
INFO_COLUMNS = ("framework", "timed_steps", "warmup_steps", "valid_tps_per_gpu", "peak_rss_gib", "predicted_step_s",
                "predicted_tps_per_gpu", "predicted_peak_allocated_gib", "plan_calibration", "device", "recorded_at")
COLUMNS = CONFIG_COLUMNS + MEASURE_COLUMNS + INFO_COLUMNS
#: Plan fields a row cannot carry: calibrate prices the row without them (said when the recorder is made).
UNCARRIED_TRAIN_FIELDS = {"data": "the --lengths distribution (calibrate prices uniform documents of "
                                  "document_length)",
                          "stage_layers": "the pipeline stage split (calibrate uses the balanced default)"}
#: ModelSpec fields a config.json does not carry and that do not change a prediction.
_MODEL_FIELDS_IGNORED = {"name", "published_params", "published_active_params", "max_position_embeddings"}
#: Bound on an existing CSV the recorder rewrites (calibrate's own bound on a run file).
MAX_CSV_BYTES = 1 << 26


# ----- the file ------------------------------------------------------------------------------------------


def check_record_path(path: str | os.PathLike) -> Path:
    """``path`` as the CSV a run appends its row to, or a one-line :class:`RuntimeConfigError` saying why it
    cannot be: not ``.csv`` (calibrate reads CSVs by the suffix), a folder, a parent that cannot be made or
    written, or an existing file that is not writable or is not a runs CSV (never overwritten)."""
    file = Path(path).expanduser()
    where = f"calibration CSV {str(path)!r}"
    if file.is_dir():
        raise RuntimeConfigError(f"{where} is a folder: give a file path, e.g. {file / 'runs.csv'}")
    if file.suffix.lower() != ".csv":
        raise RuntimeConfigError(f"{where}: sp-plan calibrate reads run tables by their .csv suffix; name the file "
                                 f"{file.with_suffix('.csv').name}")
    parent = file.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeConfigError(f"{where}: cannot create its folder {parent} ({exc.strerror or exc}); give a "
                                 "path in a writable folder") from None
    try:  # a file really made there: access() says yes to root on read-only mounts and /proc
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{file.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise RuntimeConfigError(f"{where}: the folder {parent} is not writable ({exc.strerror or exc}); give a path "
                                 "in a writable folder") from None
    if file.exists():
        if not file.is_file():
            raise RuntimeConfigError(f"{where} exists and is not a regular file; give another path")
        try:
            with file.open("a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise RuntimeConfigError(f"{where} exists and cannot be written ({exc.strerror or exc}); fix its "
                                     "permissions or give another path") from None
        existing_header(file)  # a file that is not a runs CSV is refused, not overwritten
    return file


def existing_header(file: Path) -> list[str]:
    """The columns of an existing runs CSV ([] for an empty file); a file that is not one is refused."""
    if file.stat().st_size > MAX_CSV_BYTES:
        raise RuntimeConfigError(f"calibration CSV {file} is larger than {MAX_CSV_BYTES >> 20} MiB; start a new file")
    try:
        with file.open(newline="", encoding="utf-8") as handle:
            header = next(csv.reader(handle), [])
    except (UnicodeDecodeError, csv.Error) as exc:
        raise RuntimeConfigError(f"calibration CSV {file} exists and is not a UTF-8 CSV ({exc}); it is not "
                                 "overwritten: give another path") from None
    if header and not {"model", "seq_len", "gpus"} <= set(header):
        raise RuntimeConfigError(f"calibration CSV {file} exists and is not a runs table (its header lacks model, "
                                 "seq_len, gpus); it is not overwritten: give another path")
    return header


@contextlib.contextmanager
def _locked(file: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``file`` (created when absent) that still names the file when held: a
    writer that replaced it meanwhile is waited out (the lock is on the inode, the rename makes a new one)."""
    try:
        import fcntl
    except ImportError:  # no advisory locks here: atomic replacement alone
        yield
        return
    while True:
        handle = open(file, "a+")  # noqa: SIM115 - held across the yield, closed in the finally
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                same = os.fstat(handle.fileno()).st_ino == os.stat(file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield
                return
        finally:
            handle.close()  # closing releases the lock


def append_row(path: str | os.PathLike, row: Mapping[str, Any]) -> None:
    """Append ``row`` to the runs CSV at ``path`` (created with a header when absent or empty): the file is
    rewritten whole, atomically, under a lock, with the union of its columns and the row's (existing order
    first), so earlier rows (hand-written ones with other columns included) stay as they were."""
    file = check_record_path(path)
    with _locked(file):
        header = existing_header(file)
        rows: list[dict[str, str]] = []
        if header:
            with file.open(newline="", encoding="utf-8") as handle:
                rows = [dict(r) for r in csv.DictReader(handle)]
        fields = list(header) + [c for c in row if c not in header]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n", restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items() if k is not None} for r in rows)
        writer.writerow({k: _text(v) for k, v in row.items()})
        atomic_write_text(file, buffer.getvalue(), error=RuntimeConfigError)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return str(value)


# ----- what the row names: model and topology --------------------------------------------------------


def files_folder(csv_path: Path) -> Path:
    """Where the model configs and topologies a CSV's rows name are kept: ``<stem>-files/`` beside it."""
    return csv_path.parent / f"{csv_path.stem}-files"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip(".-") or "model"
    return cleaned[:80]


def spec_config_dict(spec) -> dict[str, Any]:
    """A Hugging Face config.json dict of a dense ModelSpec (the families :func:`hf_model_from_spec` builds:
    Qwen3 with q/k norms, Qwen2 with QKV biases, else Llama); the caller checks it reads back as ``spec``."""
    model_type = "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama"
    config = {"architectures": [f"{model_type.capitalize()}ForCausalLM"], "model_type": model_type,
              "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
              "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
              "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
              "tie_word_embeddings": spec.tied_embeddings, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    if spec.max_position_embeddings:
        config["max_position_embeddings"] = spec.max_position_embeddings
    if spec.mlp_bias:
        config["mlp_bias"] = True
    if spec.sliding_window is not None:
        config["sliding_window"] = spec.sliding_window
    return config


def _model_difference(a, b) -> list[str]:
    da, db = a.model_dump(mode="json"), b.model_dump(mode="json")
    return [f"{k}: {da.get(k)!r} vs {db.get(k)!r}" for k in sorted(set(da) | set(db))
            if k not in _MODEL_FIELDS_IGNORED and da.get(k) != db.get(k)]


def model_reference(spec, hf_config: Mapping[str, Any] | None = None) -> tuple[str | None, str | None]:
    """How a row names the model ``spec``: ``(preset name, None)`` when a shipped preset is that model, else
    ``(None, config.json text)`` whose parse is ``spec`` (the HF model's own config when given and faithful,
    else one made from the spec). A model no config.json describes is refused in one line."""
    from sp_plan.cost_models.model_spec import get_model_preset, model_from_hf_dict

    try:
        preset = get_model_preset(spec.name)
    except CostModelError:
        preset = None
    if preset is not None and not _model_difference(preset, spec):
        return spec.name, None
    problems = []
    for config in ([dict(hf_config)] if hf_config else []) + ([] if spec.moe or spec.mla else [spec_config_dict(spec)]):
        try:
            parsed = model_from_hf_dict(config, name=spec.name)
        except CostModelError as exc:
            problems.append(str(exc))
            continue
        difference = _model_difference(parsed, spec)
        if not difference:
            return None, json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"
        problems.append("; ".join(difference[:3]))
    raise RuntimeConfigError(
        f"cannot record calibration rows for {spec.name}: calibrate names a model by preset or config.json, and "
        f"no config.json at hand describes it ({'; '.join(problems) or 'no HF config and the spec has experts or MLA'}); "
        "pass the model's HF config (CalibrationCallback(model_config=...)) or plan with --model CONFIG.JSON")


def topology_reference(plan, topology: Any = None, probed: Any = None) -> tuple[str | None, str | None]:
    """How a row names the topology the plan's prediction used: ``(preset reference, None)`` or ``(None, YAML
    text)`` to be written beside the CSV. ``topology``: what the caller planned on (a Topology, a preset or a
    file; a file is snapshotted); ``probed``: the topology ``auto_configure`` probed (rank 0). Else the plan's
    ``hardware.topology`` when it is a shipped preset; a name that is neither is refused in one line."""
    from sp_plan.cost_models import data
    from sp_plan.cost_models.topology import load_topology
    from sp_plan.cost_models.topology.presets import spec_to_yaml

    chosen = topology if topology is not None else probed
    if chosen is not None and hasattr(chosen, "spec"):
        return None, spec_to_yaml(chosen.spec)
    ref = str(chosen if chosen is not None else plan.hardware.topology).strip()
    base = ref.rpartition("@")[0] if "@" in ref else ref
    try:
        loaded = load_topology(ref)
        user_file = data.is_user_file("topologies", base)
    except CostModelError as exc:
        if chosen is not None:
            raise RuntimeConfigError(f"calibration rows: topology {ref!r}: {exc}") from None
        raise RuntimeConfigError(
            f"calibration rows: the plan was predicted on topology {ref!r}, which is not a shipped preset, and no "
            "topology file was given: pass the file it was planned on (CalibrationCallback(topology=FILE), "
            "Trainer(calibration_topology=FILE), sp-plan train --topology FILE)") from None
    if user_file:
        return None, spec_to_yaml(loaded.spec)
    return ref, None


def device_problem(plan, device_type: str | None, device_name: str | None = None) -> str | None:
    """Why a run on this device must not calibrate the plan's hardware (a CPU run of a GPU plan, or the
    reverse), or None; another GPU model than planned is only noted (:func:`device_note`)."""
    if device_type is None:
        return None
    planned_cpu = plan.hardware.gpu.lower().startswith("cpu")
    if device_type == "cpu" and not planned_cpu:
        return (f"calibration rows: the plan was made for {plan.hardware.gpu} ({plan.hardware.topology}) but this run is "
                f"on CPU: its row would calibrate {plan.hardware.gpu} with CPU timings; plan on this machine "
                "(auto_configure without topology=, sp-plan train without --plan/--topology) or record on the GPUs "
                "the plan is for")
    if device_type != "cpu" and planned_cpu:
        return (f"calibration rows: the plan was made for CPU ranks ({plan.hardware.gpu}) but this run is on "
                f"{device_type}: plan for the GPUs that run it")
    return None


def device_note(plan, device_name: str | None) -> str | None:
    """A note when the GPU's reported name does not mention the planned GPU's family (``h100`` of
    ``h100-80gb``): the row still names the planned hardware."""
    if not device_name or plan.hardware.gpu.lower().startswith("cpu"):
        return None
    family = plan.hardware.gpu.lower().split("-")[0]
    if family and family not in device_name.lower().replace(" ", ""):
        return (f"note: this GPU reports {device_name!r}, the plan was made for {plan.hardware.gpu}: the row names the "
                "planned hardware; plan for this GPU if that is not it")
    return None


# ----- the row -----------------------------------------------------------------------------------------


def config_columns(plan, model: str, topology: str, stack: str) -> dict[str, Any]:
    """The configuration columns of a row for ``plan`` (every option written, defaults too)."""
    train, layout = plan.train, plan.layout
    return {"model": model, "seq_len": train.seq_len, "gpus": layout.world, "topology": topology,
            "gpu": plan.hardware.gpu, "tp": layout.tp, "ulysses": layout.ulysses, "ring": layout.ring,
            "dp_shard": layout.dp_shard, "dp_replicate": layout.dp_replicate, "pp": layout.pp, "ep": layout.ep,
            "micro_batch": train.micro_batch, "grad_accum": train.grad_accum, "dtype": train.dtype,
            "optimizer": train.optimizer, "zero": train.zero_stage, "checkpointing": train.checkpointing,
            "offload_optimizer": train.offload_optimizer, "offload_params": train.offload_params,
            "offload_checkpoints": train.offload_checkpoints, "tiled_mlp": train.tiled_mlp,
            "tiled_loss": train.tiled_loss, "fp8_linears": train.fp8_linears, "compiled": train.compiled,
            "document_length": train.document_length, "attention_kernel": train.attention_kernel,
            "tp_sequence_parallel": train.tp_sequence_parallel, "pipeline_schedule": train.pipeline_schedule,
            "virtual_stages": train.virtual_stages, "stack": stack}


def read_back(row: Mapping[str, Any], stack: str, folder: Path) -> Any:
    """The MeasuredRun calibrate reads from ``row`` (written to a CSV in ``folder``)."""
    from sp_plan.planner.fitting.user_runs import runs_from_csv

    file = folder / "row.csv"
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(row), lineterminator="\n")
    writer.writeheader()
    writer.writerow({k: _text(v) for k, v in row.items()})
    file.write_text(buffer.getvalue(), encoding="utf-8")
    return runs_from_csv(file, stack)[0]


def row_problems(plan, run) -> tuple[list[str], list[str]]:
    """(fields the row describes differently from the plan, fields it cannot carry) after a read-back."""
    wrong = []
    if run.layout != plan.layout:
        wrong.append(f"layout {run.layout.describe()} vs the plan's {plan.layout.describe()}")
    wrong += [f"model {d}" for d in _model_difference(run.model, plan.model)]
    got, want = run.train.model_dump(mode="json"), plan.train.model_dump(mode="json")
    uncarried = [UNCARRIED_TRAIN_FIELDS[k] for k in UNCARRIED_TRAIN_FIELDS if want.get(k) is not None]
    wrong += [f"{k}: {got.get(k)!r} vs the plan's {want.get(k)!r}" for k in sorted(want)
              if k not in UNCARRIED_TRAIN_FIELDS and got.get(k) != want.get(k)]
    return wrong, uncarried


@dataclass
class StepMeasurement:
    """One optimizer step as recorded: wall seconds, and what was measured of it (None: not measured)."""

    step: int
    seconds: float
    tps_per_gpu: float
    valid_tokens: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    rss_bytes: int | None = None


def _num(value: float | None, unit: str = "", digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"
    return text + unit


def _ratio(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return ""
    return f"{measured / predicted:.2f}x"


class CalibrationRecorder:
    """One run's calibration row (see the module doc). Make it before training (its checks are the
    refusals), :meth:`record_step` after every optimizer step, :meth:`finish` at the end.

    ``plan``: the plan that ran (:class:`sp_plan.planner.plan.Plan`); ``rank0``: whether this process records
    (global rank 0; the others keep nothing); ``topology``/``probed_topology``/``model_config``: see
    :func:`topology_reference` and :func:`model_reference`; ``stack``: the stack that ran (default the plan's);
    ``framework``: what drove the steps (a column for the reader); ``device_type``/``device_name``: where it
    runs (a CPU run of a GPU plan is refused); ``log_every``: print every Nth step beside the prediction
    (0: only the summary)."""

    def __init__(self, path: str | os.PathLike, plan, *, rank0: bool = True, topology: Any = None,
                 probed_topology: Any = None, model_config: Mapping[str, Any] | None = None, stack: str | None = None,
                 framework: str = "sp-plan", warmup_steps: int = DEFAULT_WARMUP_STEPS, log_every: int = 0,
                 device_type: str | None = None, device_name: str | None = None,
                 print_fn: Callable[[str], None] | None = None) -> None:
        if warmup_steps < 0:
            raise RuntimeConfigError(f"warmup_steps ({warmup_steps}) must be >= 0")
        self.plan, self.rank0, self.framework, self.warmup_steps = plan, rank0, framework, warmup_steps
        self.stack = stack or plan.stack
        self.log_every = max(0, int(log_every))
        self.print_fn = print_fn
        self.steps: list[StepMeasurement] = []
        self.device_name = device_name
        self.row: dict[str, Any] | None = None
        self.path: Path | None = None
        if not rank0:
            return
        self.path = check_record_path(path)
        problem = device_problem(plan, device_type, device_name)
        if problem:
            raise RuntimeConfigError(problem)
        note = device_note(plan, device_name)
        preset, self._config_text = model_reference(plan.model, model_config)
        topo_ref, self._topology_text = topology_reference(plan, topology, probed_topology)
        folder = files_folder(self.path)
        self._files: dict[Path, str] = {}
        if self._config_text is not None:
            model_dir = folder / f"{_safe_name(plan.model.name)}-{_digest(self._config_text)}"
            self._files[model_dir / "config.json"] = self._config_text
            preset = str(model_dir.resolve())
        if self._topology_text is not None:
            topo_file = folder / f"topology-{_digest(self._topology_text)}.yaml"
            self._files[topo_file] = self._topology_text
            topo_ref = str(topo_file.resolve())
        self.config = config_columns(plan, preset, topo_ref, self.stack)
        self._check_read_back()
        if note:
            self._say(note)

    # -- checks -----------------------------------------------------------------------------------------
    def _check_read_back(self) -> None:
        """Read the row back as calibrate will (model and topology files included, in a scratch folder)."""
        with tempfile.TemporaryDirectory(prefix="sp-plan-row-") as tmp:
            scratch, row = Path(tmp), dict(self.config)
            for target, text in self._files.items():
                copy = scratch / target.relative_to(files_folder(self.path))
                copy.parent.mkdir(parents=True, exist_ok=True)
                copy.write_text(text, encoding="utf-8")
                if target.name == "config.json":
                    row["model"] = str(copy.parent)
                else:
                    row["topology"] = str(copy)
            row["step_s"] = 1.0
            try:
                run = read_back(row, self.stack, scratch)
            except CostModelError as exc:
                raise RuntimeConfigError(f"calibration rows: calibrate could not read this plan's row: {exc}") from None
        wrong, uncarried = row_problems(self.plan, run)
        if wrong:
            raise RuntimeConfigError("calibration rows: a calibrate CSV cannot describe this plan (" + "; ".join(wrong)
                                     + "): its rows would calibrate another configuration")
        if uncarried:
            self._say("note: the calibration row cannot carry " + " and ".join(uncarried))

    # -- per step -------------------------------------------------------------------------------------------
    @property
    def tokens_per_step(self) -> int:
        t, layout = self.plan.train, self.plan.layout
        return t.seq_len * t.micro_batch * t.grad_accum * layout.dp

    def predicted(self) -> dict[str, float | None]:
        """The plan's prediction: step seconds, tokens/s per GPU, peak allocated GiB (None where absent)."""
        estimate = self.plan.estimate or {}
        time_, memory = estimate.get("time") or {}, estimate.get("memory") or {}
        world = self.plan.layout.world
        tps = time_.get("tokens_per_s")
        peak = memory.get("peak_allocated")
        return {"step_s": time_.get("step_s"), "tps_per_gpu": tps / world if tps else None,
                "peak_allocated_gib": peak / GiB if peak else None}

    def record_step(self, step: int, seconds: float, *, valid_tokens: int | None = None,
                    allocated: int | None = None, reserved: int | None = None, rss: int | None = None) -> None:
        """One optimizer step: wall ``seconds``; ``valid_tokens`` of all ranks; memory bytes (None or negative:
        not measured). Printed beside the prediction every ``log_every`` steps."""
        if not self.rank0:
            return
        world = self.plan.layout.world
        tps = self.tokens_per_step / seconds / world if seconds > 0 else math.nan

        def known(value: int | None) -> int | None:
            return int(value) if value is not None and value >= 0 else None

        measurement = StepMeasurement(step=step, seconds=seconds, tps_per_gpu=tps, valid_tokens=valid_tokens,
                                      allocated_bytes=known(allocated), reserved_bytes=known(reserved),
                                      rss_bytes=known(rss))
        self.steps.append(measurement)
        if self.log_every and step % self.log_every == 0:
            self._say(self.step_line(measurement, warm=len(self.steps) <= self.warmup_steps))

    def step_line(self, m: StepMeasurement, warm: bool = False) -> str:
        """One step beside the plan's prediction."""
        p = self.predicted()
        tag = " (warm-up)" if warm else ""
        parts = [f"calibration step {m.step}{tag}: {_num(m.seconds, ' s', 4)} (plan {_num(p['step_s'], ' s', 4)})",
                 f"{_num(m.tps_per_gpu)} tokens/s/GPU (plan {_num(p['tps_per_gpu'])})"]
        if m.allocated_bytes is not None:
            parts.append(f"peak {m.allocated_bytes / GiB:.3g} GiB allocated (plan {_num(p['peak_allocated_gib'])}) / "
                         f"{_num((m.reserved_bytes or 0) / GiB)} GiB reserved")
        return ", ".join(parts)

    # -- the row ------------------------------------------------------------------------------------------
    def steady(self) -> list[StepMeasurement]:
        """The steps the row summarises: those after the first ``warmup_steps`` of this run."""
        return self.steps[self.warmup_steps:]

    def finish(self, *, step_s: float | None = None, allocated: int | None = None, reserved: int | None = None,
               rss: int | None = None) -> dict[str, Any] | None:
        """Append the run's row and print it beside the prediction (rank 0); returns the row, or None when no
        steady step ran (then nothing is written, and that is said). The keyword values replace what the
        recorded steps give (a caller that reduced them over the ranks: the slowest rank's median step, the
        largest peaks)."""
        if not self.rank0:
            return None
        steady = self.steady()
        if not steady and step_s is None:
            self._say(f"calibration: no row written to {self.path}: {len(self.steps)} step(s) ran, all of them "
                      f"warm-up (the first {self.warmup_steps} are left out); train more steps")
            return None
        median = step_s if step_s is not None else statistics.median(m.seconds for m in steady)

        def peak(values: list[int | None], given: int | None) -> int | None:
            if given is not None:
                return given if given >= 0 else None
            known = [v for v in values if v is not None]
            return max(known) if known else None

        alloc = peak([m.allocated_bytes for m in steady], allocated)
        resv = peak([m.reserved_bytes for m in steady], reserved)
        peak_rss = peak([m.rss_bytes for m in steady], rss)
        world = self.plan.layout.world
        valid = [m.valid_tokens for m in steady if m.valid_tokens is not None]
        valid_tps = (sum(valid) / sum(m.seconds for m in steady) / world
                     if valid and len(valid) == len(steady) and sum(m.seconds for m in steady) > 0 else None)
        predicted = self.predicted()
        now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
        layout = self.plan.layout.describe()
        row: dict[str, Any] = dict(self.config)
        row.update({
            "step_s": median, "tps_per_gpu": self.tokens_per_step / median / world if median > 0 else None,
            "peak_allocated_gib": alloc / GiB if alloc is not None else None,
            "reserved_gib": resv / GiB if resv is not None else None,
            "id": f"{self.framework}: {self.plan.model.name} {layout} {self.plan.train.seq_len} tokens "
                  f"{now.strftime('%Y-%m-%dT%H:%M:%SZ')} {_digest(str(os.getpid()) + now.isoformat() + layout)[:4]}",
            "framework": self.framework, "timed_steps": len(steady) or "",
            "warmup_steps": min(self.warmup_steps, len(self.steps)), "valid_tps_per_gpu": valid_tps,
            "peak_rss_gib": peak_rss / GiB if peak_rss is not None else None,
            "predicted_step_s": predicted["step_s"], "predicted_tps_per_gpu": predicted["tps_per_gpu"],
            "predicted_peak_allocated_gib": predicted["peak_allocated_gib"],
            "plan_calibration": self.plan.calibration, "device": self.device_name, "recorded_at": now.isoformat(),
        })
        for target, text in self._files.items():
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(target, text, error=RuntimeConfigError)
        append_row(self.path, row)
        self.row = row
        self._say("\n".join(self.summary_lines(row)))
        return row

    def summary_lines(self, row: Mapping[str, Any]) -> list[str]:
        """The run beside the plan's prediction, and where the row went."""
        p = self.predicted()
        t = self.plan.train
        timed = row.get("timed_steps")
        first = [(f"calibration: {self.plan.model.name} {self.plan.layout.describe()}, {t.seq_len:,} tokens x "
                  f"{t.micro_batch} x {t.grad_accum} micro-batch(es), stack {self.stack}, {self.framework}: median of "
                  f"{timed or 'the'} steady step(s) after {row.get('warmup_steps')} warm-up")]
        lines = [("step time", row.get("step_s"), p["step_s"], " s"),
                 ("tokens/s per GPU", row.get("tps_per_gpu"), p["tps_per_gpu"], ""),
                 ("peak allocated", row.get("peak_allocated_gib"), p["peak_allocated_gib"], " GiB"),
                 ("peak reserved", row.get("reserved_gib"), None, " GiB")]
        on_cpu = self.plan.hardware.gpu.lower().startswith("cpu")
        for label, measured, predicted, unit in lines:
            text = _num(measured, unit, 4) if measured is not None else ("n/a on CPU" if on_cpu else "not measured")
            ratio = _ratio(measured, predicted)
            first.append(f"  {label:<17} measured {text:<14} predicted {_num(predicted, unit, 4):<14}"
                         + (f" measured/predicted {ratio}" if ratio else ""))
        first.append(f"  row appended to {self.path}; fit it with: sp-plan calibrate {self.path}")
        return first

    def _say(self, text: str) -> None:
        if not self.rank0:
            return
        if self.print_fn is not None:
            self.print_fn(text)
        else:
            ensure_logging()
            LOG.info(text)


__all__ = ["COLUMNS", "DEFAULT_WARMUP_STEPS", "CalibrationRecorder", "StepMeasurement", "append_row",
           "check_record_path", "model_reference", "topology_reference"]
