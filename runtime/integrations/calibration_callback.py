"""A ``transformers.TrainerCallback`` that turns a Trainer run into a row for ``sp-plan calibrate``.

It works in transformers' ``Trainer`` and in TRL's ``SFTTrainer`` (any Trainer subclass): per optimizer step it
records the wall time (step end to step end: data, forward, backward, optimizer and logging, as the run
spends it; CUDA synchronised), tokens/s per GPU and, on GPUs, the peak memory (``max_memory_allocated`` /
``max_memory_reserved`` since the warm-up, the largest over the ranks); at the end of training it prints them
beside the plan's prediction and appends one row (the slowest rank's median steady step) to a CSV that
``sp-plan calibrate`` reads as it is (:mod:`sp_plan.runtime.calibration_rows`)::

    setup = auto_configure(model, seq_len=8192, ...)
    trainer = SequenceParallelTrainer(setup, args, train_dataset=data, calibration_csv="runs.csv")  # adds it
    # or, in any Trainer, with the plan the run follows:
    trainer = Trainer(model=model, args=args, callbacks=[CalibrationCallback("runs.csv", plan="plan.yaml")])
    trainer.train()            # ... then: sp-plan calibrate runs.csv --out calibration.yaml

The layout, options and stack in the row are the plan's (the run is checked to follow it: world size,
micro-batch and gradient accumulation); a plan made on a topology file needs ``topology=`` that file, and
on CPU ranks the memory columns stay empty (there are no CUDA allocator statistics; the process's peak RSS
is kept in an information column). Only global rank 0 writes. Bad input (a path that cannot be written,
a plan no row can describe, a GPU plan run on CPU) is one :class:`RuntimeConfigError` before training.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from sp_plan.runtime.calibration_rows import DEFAULT_WARMUP_STEPS, CalibrationRecorder, check_record_path
from sp_plan.runtime.errors import RuntimeConfigError
from transformers import TrainerCallback


def _rank0() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _agree(problem: str | None) -> str | None:
    """Rank 0's problem on every rank (collective when the process group is up), so all ranks refuse together
    instead of the others waiting in their first collective for a rank that stopped."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _peak_rss() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except (ImportError, OSError):
        return -1


def _hf_config(model: Any) -> Mapping[str, Any] | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    from sp_plan.cost_models.hf_config import config_object_dict

    return config_object_dict(config)


class CalibrationCallback(TrainerCallback):
    """Record the run for ``sp-plan calibrate`` (see the module doc).

    ``path``: the CSV rows are appended to (``.csv``). ``setup``: an
    :class:`~sp_plan.runtime.auto.AutoConfigured` (its plan, probed topology and model), or ``plan``: the
    :class:`~sp_plan.planner.plan.Plan` (or plan file) a plain Trainer's run follows. ``topology``: the topology
    file (or Topology) the plan was made on, when it is not a shipped preset. ``stack``: the stack that ran
    (default: the plan's). ``warmup_steps``: first steps left out of the row. ``log_every``: print every Nth
    step beside the prediction (default: the Trainer's ``logging_steps``; 0: only the summary). ``framework``:
    the row's framework column (default: the Trainer class, e.g. ``transformers.Trainer``).
    ``steps``/``row``: what was recorded (rank 0).
    """

    def __init__(self, path: str | os.PathLike, setup: Any = None, *, plan: Any = None, topology: Any = None,
                 stack: str | None = None, warmup_steps: int = DEFAULT_WARMUP_STEPS, log_every: int | None = None,
                 framework: str | None = None, model_config: Mapping[str, Any] | None = None,
                 print_fn: Callable[[str], None] | None = None) -> None:
        if (setup is None) == (plan is None):
            raise RuntimeConfigError("CalibrationCallback needs the plan the run follows: setup= (what auto_configure "
                                     "returned) or plan= (a Plan or plan file), one of them")
        if setup is not None:
            plan, probed, device = setup.plan, setup.probed_topology, setup.device
            model_config = model_config if model_config is not None else _hf_config(setup.model)
        else:
            if isinstance(plan, (str, os.PathLike)):
                from sp_plan.planner.plan import load_plan

                plan = load_plan(plan)
            probed, device = None, None
        self.plan, self.path, self.framework = plan, Path(path), framework
        self._kwargs = {"topology": topology, "probed_topology": probed, "model_config": model_config,
                        "stack": stack, "warmup_steps": warmup_steps, "print_fn": print_fn}
        self._log_every = log_every
        self._device = device
        self.recorder: CalibrationRecorder | None = None
        self._times: list[float] = []
        self._last: float | None = None
        self._reset_done = False
        if dist.is_available() and dist.is_initialized():  # the ranks are up: refuse now, together
            self._make_recorder()
        elif _rank0():  # a plain Trainer's callback, made before the process group: the path at least, now
            check_record_path(self.path)

    # -- set-up ---------------------------------------------------------------------------------------------
    def _device_of(self) -> tuple[str, str | None]:
        if self._device is not None:
            device = torch.device(self._device)
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return device.type, name

    def _make_recorder(self, framework: str | None = None, log_every: int = 0) -> None:
        problem = None
        device_type, device_name = self._device_of()
        try:
            self.recorder = CalibrationRecorder(
                self.path, self.plan, rank0=_rank0(), framework=self.framework or framework or "transformers.Trainer",
                log_every=self._log_every if self._log_every is not None else log_every, device_type=device_type,
                device_name=device_name, **self._kwargs)
        except RuntimeConfigError as exc:
            problem = str(exc)
        problem = _agree(problem)
        if problem:
            self.recorder = None
            raise RuntimeConfigError(problem)

    def bind(self, trainer: Any) -> None:
        """Name the framework after the Trainer class that runs it (``trl.SFTTrainer``, ...)."""
        if self.framework is None:
            self.framework = trainer_framework(trainer)
            if self.recorder is not None:
                self.recorder.framework = self.framework

    def _check_arguments(self, args: Any) -> None:
        """The run must be the plan's: world size, micro-batch and gradient accumulation."""
        train, layout = self.plan.train, self.plan.layout
        problems = []
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != layout.world:
            problems.append(f"{world} process(es) run it but the plan's layout ({layout.describe()}) has {layout.world}")
        if args.per_device_train_batch_size != train.micro_batch:
            problems.append(f"per_device_train_batch_size={args.per_device_train_batch_size} but the plan's "
                            f"micro-batch is {train.micro_batch}")
        if args.gradient_accumulation_steps != train.grad_accum:
            problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} but the plan's grad_accum "
                            f"is {train.grad_accum}")
        if problems:
            raise RuntimeConfigError("CalibrationCallback: this run is not the plan's, so its row would describe "
                                     "another run (" + "; ".join(problems) + "); use training_arguments(plan) and "
                                     "launch the plan's GPU count")

    # -- the Trainer's events -----------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._check_arguments(args)
        if self.recorder is None:
            self._make_recorder(log_every=args.logging_steps if isinstance(args.logging_steps, int) else 0)
        elif self._log_every is None and isinstance(args.logging_steps, int):
            self.recorder.log_every = args.logging_steps
        self._times, self._reset_done = [], False
        self._sync()
        self._last = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        now = time.perf_counter()
        seconds = now - (self._last if self._last is not None else now)
        self._last = now
        self._times.append(seconds)
        cuda = self._cuda()
        allocated = torch.cuda.max_memory_allocated() if cuda else None
        reserved = torch.cuda.max_memory_reserved() if cuda else None
        if self.recorder is not None:
            self.recorder.record_step(state.global_step, seconds, allocated=allocated, reserved=reserved,
                                      rss=None if cuda else _peak_rss())
        warmup = self.recorder.warmup_steps if self.recorder is not None else DEFAULT_WARMUP_STEPS
        if cuda and len(self._times) == warmup and not self._reset_done:  # the row's peaks: steady steps only
            torch.cuda.reset_peak_memory_stats()
            self._reset_done = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        """Every rank: the slowest rank's median steady step and the largest peaks; rank 0 writes the row."""
        if self.recorder is None:
            return control
        warmup = self.recorder.warmup_steps
        steady = self._times[warmup:]
        cuda = self._cuda()
        local = [statistics.median(steady) if steady else -1.0,
                 float(torch.cuda.max_memory_allocated()) if cuda else -1.0,
                 float(torch.cuda.max_memory_reserved()) if cuda else -1.0,
                 float(_peak_rss()) if not cuda else -1.0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
                else torch.device("cpu")
            values = torch.tensor(local, dtype=torch.float64, device=device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            local = values.tolist()
        step_s, allocated, reserved, rss = local
        if self.recorder.rank0:
            self.recorder.finish(step_s=step_s if step_s > 0 else None,
                                 allocated=int(allocated) if allocated >= 0 else -1,
                                 reserved=int(reserved) if reserved >= 0 else -1, rss=int(rss) if rss >= 0 else -1)
        return control

    # -- helpers -----------------------------------------------------------------------------------------------
    def _cuda(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _sync(self) -> None:
        if self._cuda():
            torch.cuda.synchronize()

    @property
    def steps(self) -> list:
        """The steps recorded (rank 0): :class:`~sp_plan.runtime.calibration_rows.StepMeasurement` objects."""
        return self.recorder.steps if self.recorder is not None else []

    @property
    def row(self) -> dict[str, Any] | None:
        """The row appended at the end of training (rank 0), or None."""
        return self.recorder.row if self.recorder is not None else None


def trainer_framework(trainer: Any) -> str:
    """``trl.SFTTrainer``, ``transformers.Trainer``, ...: the first transformers/TRL class of the trainer."""
    for cls in type(trainer).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("trl", "transformers"):
            return f"{root}.{cls.__name__}"
    return type(trainer).__name__


__all__ = ["CalibrationCallback", "trainer_framework"]
