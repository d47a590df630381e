"""A small training loop around :func:`sp_plan.runtime.step.train_step`: resume, checkpoints, exit signals, telemetry.

::

    setup = auto_configure(model, seq_len=131072)
    optimizer = setup.make_optimizer(lr=3e-4)
    data = GlobalBatches.for_setup(setup, PackedTextDataset.build("corpus.jsonl", "tokenizer/", 131072))
    result = Trainer(setup, optimizer, data, max_steps=1000, checkpoint_dir="ckpt", save_every=100,
                     resume=True, tensorboard_dir="tb").fit()

:meth:`Trainer.fit`:

1. **resume**: ``resume=True``: the newest checkpoint under ``checkpoint_dir`` that verifies against its
   manifest (newer ones that do not are skipped, each named with why); none is an error.
   ``resume="auto"``: the same, or a new run at step 0 when ``checkpoint_dir`` holds no checkpoint at
   all (step directories that all fail verification are still an error). A path: that checkpoint,
   verified. ``resume=False`` refuses a ``checkpoint_dir`` that already holds checkpoints (a new run
   would replace them). Restored: model, optimizer, scheduler, data position, RNG and step
   (:mod:`sp_plan.runtime.checkpoint`; on another layout DCP reshards). The checkpoint directory is checked for
   writability and free space (vs the newest checkpoint's size) before training starts.
   **What differs from the checkpoint** is said at resume, with this precedence: the architecture and
   the data must match (refused); the optimizer's hyperparameters (base lr, betas, eps, weight decay,
   ...), the scheduler's class and ``run_config`` (e.g. warm-up steps, gradient clipping) must match,
   else resuming is refused naming both values, unless ``override_hparams=True``: then this run's values
   win, the scheduler keeps its step count and its learning rates are rescaled by new/saved base lr;
   the layout, world size, sequence length, micro-batch, gradient accumulation and dtype are this run's
   (resharded) and listed.
2. per step: this rank's micro-batches from ``data`` (``next_step()``, e.g.
   :class:`sp_plan.runtime.text_data.GlobalBatches`), :func:`sp_plan.runtime.step.train_step` (the one step code
   path), the scheduler, telemetry;
3. **checkpoints** every ``save_every`` steps and after the last step; on SIGTERM/SIGINT (with a
   checkpoint directory) the current step finishes, every rank agrees to stop (the flag is all-reduced
   with the step's telemetry, so a signal that reaches one rank after that all-reduce stops every rank
   after the next step), a checkpoint is saved and ``fit`` returns (``stopped_by``). A second SIGINT
   acts immediately (KeyboardInterrupt); repeated SIGTERMs are ignored (launchers repeat it).
   ``async_save=True`` writes the periodic checkpoints in the background
   (:class:`sp_plan.runtime.async_checkpoint.AsyncCheckpointer`: training waits only for a copy to host memory);
   ``fit`` returns once the last one is complete.
4. **non-finite steps** (``skip_nonfinite``, on by default): a step whose loss or global gradient norm is
   NaN or infinite is not applied (the gradients are dropped, the scheduler does not advance; the batch
   is consumed and the step counts), so a bad batch or an overflow cannot turn the weights, and then
   every checkpoint, into NaN. ``max_nonfinite_steps`` such steps in a row (3) stop training with
   ``stopped_by="non-finite"`` and a checkpoint of the last finite weights.

**Telemetry** (rank 0 prints; every rank computes): per step the loss (global token mean), tokens/s
(valid tokens of all ranks / the step's wall time), the achieved **model FLOP/s per rank** = the plan's
model FLOPs per step (:func:`sp_plan.cost_models.flops.model_flops_per_step`: no recomputation) / (step time
x ranks), and on GPUs **MFU** = that / the datasheet peak the plan was made for
(``plan.estimate.time.peak_flops``). On CPU MFU is reported as not meaningful: ranks share cores
(with each other and with whatever else runs), so there is no per-rank peak, and the probe's measured
matmul rate, which the planner uses, is not one (a 4-rank CPU run measured 123% "MFU" against it). Also
the learning rate, the gradient norm, and memory, maximised over ranks: CUDA
``max_memory_allocated``/``max_memory_reserved`` of the step; on CPU the process's resident set
(current and peak RSS: it includes the Python runtime, not just tensors), plus, every
``live_bytes_every`` steps, the peak of live tensor bytes over the step measured by
:func:`sp_plan.runtime.memory_meter.live_peak` (the profiler's allocation timeline: that step runs slower).
Lines every ``log_every`` steps, a tqdm progress bar, a JSON-lines ``metrics_file``, TensorBoard
scalars (``tensorboard_dir``; needs the ``tensorboard`` package) and Weights & Biases metrics
(``wandb_project``; needs the ``[wandb]`` extra; :mod:`sp_plan.runtime.wandb_report`: also the predicted
step time, and the plan as the run's config).

**Logging**: lines go to the ``sp_plan.runtime.trainer`` logger at INFO (rank 0 only; the application
installs the handler: :mod:`sp_plan.runtime.log`, which ``sp-plan`` sets up with ``--log-level``; ``fit``
installs the default one only when neither the ``sp_plan`` nor the root logger has a handler, so a script
that configured nothing still sees its telemetry), around the progress bar; ``print_fn`` replaces the
logger (tests collect the lines with it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.json_io import finite_or_null, strict_dumps
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.log import ensure_logging, get_logger
from sp_plan.runtime.step import StepResult, train_step

if TYPE_CHECKING:
    from sp_plan.runtime.checkpoint import Piece

LOG = get_logger(__name__)

#: ``Trainer(resume=AUTO)``: resume from the newest verified checkpoint, or start a new run if there is none.
AUTO = "auto"
#: Optimizer hyperparameters compared at resume (``initial_lr``: the base lr, when a scheduler set it).
HPARAMS = ("initial_lr", "lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad",
           "maximize", "alpha", "lr_decay")
#: Memory figures reduced over ranks each step (bytes; -1 when not measured).
MEMORY_KEYS = ("max_allocated", "max_reserved", "rss", "peak_rss", "live_peak")
#: Seconds between progress reports inside one step (micro-batch k of n): a step of many micro-batches
#: can take minutes, and a run that prints nothing that long looks hung.
MICRO_BATCH_REPORT_S = 30.0


@dataclass
class StepRecord:
    """One optimizer step as telemetry sees it (``memory``: bytes, the maximum over ranks)."""

    step: int
    loss: float
    tokens: int
    seconds: float
    tokens_per_s: float
    mfu: float | None
    model_flops_per_s: float
    lr: float | None
    grad_norm: float | None
    memory: dict[str, int] = field(default_factory=dict)
    #: The optimizer step was skipped (non-finite loss or gradient norm): weights and schedule unchanged.
    skipped: bool = False


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` did: steps ``start_step + 1 .. step`` ran in this call."""

    start_step: int
    step: int
    records: list[StepRecord]
    seconds: float
    stopped_by: str | None = None
    checkpoint: Path | None = None
    resumed_from: Path | None = None

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self.records if r.skipped]


# ----- telemetry -------------------------------------------------------------------------------------------


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process; (-1, -1) where /proc or resource is missing."""
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        current = -1
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        peak = -1
    return current, max(peak, current)  # the kernel updates its high-water mark lazily


def mfu_basis(setup) -> tuple[float, float | None, str]:
    """(model FLOPs per step, peak FLOP/s per rank, a note on what the peak is) for MFU; the peak is None
    when it would not describe this run: on CPU, or a plan for another device kind."""
    from sp_plan.cost_models.flops import model_flops_per_step

    plan = setup.plan
    flops = model_flops_per_step(plan.model, plan.train, plan.layout)
    peak = (plan.estimate or {}).get("time", {}).get("peak_flops")
    gpu = plan.hardware.gpu
    if not peak:
        try:
            from sp_plan.cost_models.gpu_spec import get_gpu_preset

            peak = get_gpu_preset(gpu).flops_for(plan.train.dtype)
        except Exception:
            return flops, None, f"MFU n/a: no peak FLOP/s known for {gpu}"
    if setup.device.type == "cpu":
        if gpu.startswith("cpu"):
            return flops, None, (f"MFU n/a on CPU: ranks share cores, so there is no per-rank peak (the probe "
                                 f"measured {_flops_text(peak)} per rank for planning)")
        return flops, None, f"MFU n/a: the plan's peak is {gpu}'s ({_flops_text(peak)}), this run is on cpu"
    if gpu.startswith("cpu"):
        return flops, None, f"MFU n/a: the plan was made for {gpu}, this run is on {setup.device.type}"
    return flops, peak, f"MFU vs {gpu} {_flops_text(peak)} per rank ({plan.train.dtype} datasheet peak)"


def _flops_text(flops: float) -> str:
    if not math.isfinite(flops):
        return "n/a FLOP/s"
    return f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.1f} GFLOP/s"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


class Telemetry:
    """Per-step numbers, printed on rank 0, and optionally written as JSON lines and TensorBoard scalars."""

    def __init__(self, setup, *, total_steps: int, start_step: int = 0, log_every: int = 10,
                 tensorboard_dir: str | os.PathLike | None = None, metrics_file: str | os.PathLike | None = None,
                 progress: bool = True, live_bytes_every: int = 0, print_fn: Callable[[str], None] | None = None,
                 wandb_project: str | None = None, run_id: str | None = None) -> None:
        self.setup = setup
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.world = setup.plan.layout.world  # the ranks the plan's FLOPs are spread over
        self.cuda = setup.device.type == "cuda"
        self.log_every, self.live_bytes_every, self.print_fn = log_every, live_bytes_every, print_fn or LOG.info
        self.flops_per_step, self.peak, self.mfu_note = mfu_basis(setup)
        self.writer = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RuntimeConfigError("TensorBoard logging needs the tensorboard package: pip install tensorboard "
                                         "(or drop --tensorboard)") from None
            if self.rank0:
                self.writer = SummaryWriter(log_dir=str(tensorboard_dir))
        self.wandb = None
        if wandb_project is not None:
            from sp_plan.runtime.wandb_report import WandbReporter, import_wandb

            import_wandb()  # every rank: a missing package is the same error everywhere
            if self.rank0:
                self.wandb = WandbReporter(wandb_project, setup.plan, run_id=run_id)
        self.metrics = None
        if metrics_file is not None and self.rank0:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(metrics_file, "a")
        self.current_step: int | None = None
        self.step_started = self.last_report = time.monotonic()
        self.bar = None
        if progress and self.rank0:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def measure_live(self, step: int) -> bool:
        return not self.cuda and self.live_bytes_every > 0 and step % self.live_bytes_every == 0

    def begin_step(self, step: int | None = None) -> None:
        """Before step ``step`` (1-based) runs: reset the peak-memory counters and the in-step progress clock."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.setup.device)
        self.current_step = step
        self.step_started = self.last_report = time.monotonic()

    def micro_batch_done(self, k: int, n: int) -> None:
        """Progress inside a step of ``n`` micro-batches, at most every :data:`MICRO_BATCH_REPORT_S` seconds
        (rank 0): on the progress bar, or (without one, when lines are printed) as a line."""
        if not self.rank0 or n < 2 or k == n:
            return
        now = time.monotonic()
        if now - self.last_report < MICRO_BATCH_REPORT_S:
            return
        self.last_report = now
        text = f"micro-batch {k}/{n}"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)
        elif self.log_every:
            self.write(f"step {self.current_step}: {text} after {now - self.step_started:,.0f} s")

    def local_memory(self, live_peak: int | None) -> list[int]:
        values = dict.fromkeys(MEMORY_KEYS, -1)
        if self.cuda:
            values["max_allocated"] = torch.cuda.max_memory_allocated(self.setup.device)
            values["max_reserved"] = torch.cuda.max_memory_reserved(self.setup.device)
        else:
            values["rss"], values["peak_rss"] = _rss_bytes()
        if live_peak is not None:
            values["live_peak"] = live_peak
        return [values[k] for k in MEMORY_KEYS]

    def record(self, step: int, result: StepResult, lr: float | None, memory: list[int]) -> StepRecord:
        achieved = self.flops_per_step / (result.seconds * self.world) if result.seconds > 0 else math.nan
        mfu = achieved / self.peak if self.peak else None
        rec = StepRecord(step=step, loss=result.loss, tokens=result.tokens, seconds=result.seconds,
                         tokens_per_s=result.tokens / result.seconds if result.seconds > 0 else math.nan, mfu=mfu,
                         model_flops_per_s=achieved,
                         lr=lr, grad_norm=result.grad_norm,
                         memory={k: v for k, v in zip(MEMORY_KEYS, memory) if v >= 0}, skipped=result.skipped)
        if not self.rank0:
            return rec
        if self.metrics is not None:
            self.metrics.write(strict_dumps(finite_or_null(asdict(rec))) + "\n")
            self.metrics.flush()
        if self.writer is not None:
            self._tensorboard(rec)
        if self.wandb is not None:
            self.wandb.log(rec)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec.loss:.3f}", tok_s=f"{rec.tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        if self.log_every and step % self.log_every == 0:
            self.write(self.line(rec))
        return rec

    def _tensorboard(self, rec: StepRecord) -> None:
        w = self.writer
        w.add_scalar("train/loss", rec.loss, rec.step)
        w.add_scalar("train/tokens_per_s", rec.tokens_per_s, rec.step)
        w.add_scalar("train/step_seconds", rec.seconds, rec.step)
        w.add_scalar("train/model_flops_per_s_per_rank", rec.model_flops_per_s, rec.step)
        if rec.mfu is not None:
            w.add_scalar("train/mfu", rec.mfu, rec.step)
        if rec.lr is not None:
            w.add_scalar("train/lr", rec.lr, rec.step)
        if rec.grad_norm is not None:
            w.add_scalar("train/grad_norm", rec.grad_norm, rec.step)
        for k, v in rec.memory.items():
            w.add_scalar(f"memory/{k}_bytes", v, rec.step)

    def line(self, rec: StepRecord) -> str:
        parts = [f"step {rec.step}", f"loss {rec.loss:.4f}", f"{rec.tokens_per_s:,.0f} tok/s"]
        parts.append(f"{_flops_text(rec.model_flops_per_s)}/rank")
        if rec.mfu is not None:
            parts.append(f"MFU {100 * rec.mfu:.2f}%")
        m = rec.memory
        if "max_allocated" in m:
            parts.append(f"mem {_gb(m['max_allocated'])} alloc / {_gb(m['max_reserved'])} reserved")
        elif "rss" in m:
            parts.append(f"RSS {_gb(m['rss'])}")
        if "live_peak" in m:
            parts.append(f"live tensors {_gb(m['live_peak'])}")
        if rec.lr is not None:
            parts.append(f"lr {rec.lr:.2e}")
        if rec.grad_norm is not None:
            parts.append(f"grad norm {rec.grad_norm:.3f}")
        if rec.skipped:
            parts.append("SKIPPED (not finite)")
        return " | ".join(parts)

    def write(self, text: str) -> None:
        if not self.rank0:
            return
        if self.bar is not None:
            with self.bar.external_write_mode():  # the bar is cleared, the line written, the bar redrawn
                self.print_fn(text)
        else:
            self.print_fn(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


# ----- exit signals ----------------------------------------------------------------------------------------


class _ExitSignals:
    """SIGTERM/SIGINT set a flag (the loop finishes its step, saves and stops). A second SIGINT goes to the
    previous handler (KeyboardInterrupt: Ctrl-C twice forces); repeated SIGTERMs are ignored, since launcher
    stacks deliver it more than once (SLURM signals every task and torchrun forwards its own, for
    instance) and the launcher's SIGKILL follows anyway."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _ExitSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            return
        if signum == signal.SIGTERM:
            return
        previous = self._previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


# ----- the loop --------------------------------------------------------------------------------------------


class Trainer:
    """Train ``setup`` (an :class:`sp_plan.runtime.auto.AutoConfigured`) for ``max_steps`` optimizer steps; see the
    module docstring. ``data``: an object with ``next_step()`` (this rank's micro-batches of the next
    step), ``state_dict()`` and ``load_state_dict()`` (:class:`sp_plan.runtime.text_data.GlobalBatches`).
    ``resume``: False, True (the newest verified checkpoint under ``checkpoint_dir``; an error if there is
    none), ``"auto"`` (the same, or a new run when the directory holds no checkpoint) or a checkpoint path.
    ``override_hparams``: resume even when the optimizer's hyperparameters, the scheduler's class or
    ``run_config`` differ from the checkpoint's (this run's values then apply). ``run_config``: JSON-able
    settings of the run that the optimizer and scheduler states do not capture (warm-up length, ...),
    saved with every checkpoint and compared at resume. ``on_step(trainer, record)`` runs after every
    step (all ranks). ``checkpoint_pieces``: more named state to checkpoint and restore beside the model,
    optimizer, scheduler, data, RNG and step (:class:`sp_plan.runtime.checkpoint.Piece` objects).
    ``wandb_project``: also report every step to this Weights & Biases project (rank 0; ``WANDB_MODE`` and
    ``WANDB_DIR`` apply; needs the ``[wandb]`` extra, else a :class:`RuntimeConfigError` at construction).
    ``calibration_csv``: at the end of ``fit`` append the run's row for ``sp-plan calibrate`` to this CSV (rank 0;
    the median steady step after the first two, tokens/s per GPU, CUDA peak memory; printed beside the plan's
    prediction: :class:`sp_plan.runtime.calibration_rows.CalibrationRecorder`); ``calibration_topology``: the
    topology file or preset the plan was made on, when the plan does not name a shipped preset and none was
    probed. A path or plan the row cannot use is refused here, on every rank.
    """

    def __init__(self, setup, optimizer, data, *, max_steps: int, scheduler=None, max_grad_norm: float | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, save_every: int = 0, keep_checkpoints: int | None = 2,
                 resume: bool | str | os.PathLike = False, override_hparams: bool = False,
                 run_config: Mapping[str, Any] | None = None, log_every: int = 10,
                 tensorboard_dir: str | os.PathLike | None = None, metrics_file: str | os.PathLike | None = None,
                 progress: bool = True, handle_signals: bool | None = None, live_bytes_every: int = 0,
                 async_save: bool = False, skip_nonfinite: bool = True, max_nonfinite_steps: int = 3,
                 print_fn: Callable[[str], None] | None = None, wandb_project: str | None = None,
                 on_step: Callable[[Trainer, StepRecord], None] | None = None,
                 checkpoint_pieces: Sequence[Piece] = (), calibration_csv: str | os.PathLike | None = None,
                 calibration_topology: Any = None) -> None:
        if wandb_project is not None:
            from sp_plan.runtime.wandb_report import import_wandb

            import_wandb()  # refuse before any step runs
        if max_steps < 0 or save_every < 0:
            raise RuntimeConfigError(f"max_steps ({max_steps}) and save_every ({save_every}) must be >= 0")
        if max_nonfinite_steps < 1:
            raise RuntimeConfigError(f"max_nonfinite_steps ({max_nonfinite_steps}) must be >= 1: the number of "
                                     "non-finite steps in a row that stops training")
        if (save_every or resume is True or resume == AUTO) and checkpoint_dir is None:
            raise RuntimeConfigError(f"save_every and resume=True/{AUTO!r} need a checkpoint directory "
                                     "(checkpoint_dir=...)")
        try:
            json.dumps(dict(run_config or {}))
        except (TypeError, ValueError) as exc:
            raise RuntimeConfigError(f"run_config must be JSON-able (it is saved with every checkpoint): {exc}") \
                from None
        if not all(hasattr(data, a) for a in ("next_step", "state_dict", "load_state_dict")):
            raise RuntimeConfigError(
                f"data must provide next_step(), state_dict() and load_state_dict() (e.g. sp_plan.runtime.text_data."
                f"GlobalBatches), got {type(data).__name__}"
            )
        self.setup, self.optimizer, self.data, self.scheduler = setup, optimizer, data, scheduler
        self.max_steps, self.max_grad_norm = max_steps, max_grad_norm
        self.skip_nonfinite, self.max_nonfinite_steps = skip_nonfinite, max_nonfinite_steps
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.save_every, self.keep_checkpoints, self.resume = save_every, keep_checkpoints, resume
        self.override_hparams = override_hparams
        self.run_config = {"max_grad_norm": max_grad_norm, **dict(run_config or {})}
        #: Identifies this run's checkpoints (a step this run saved is not saved again; another run's is
        #: replaced, and that is said); rank 0's, set by fit.
        self.run_id: str | None = None
        self.handle_signals = self.checkpoint_dir is not None if handle_signals is None else handle_signals
        self.telemetry_kwargs = dict(log_every=log_every, tensorboard_dir=tensorboard_dir, metrics_file=metrics_file,
                                     progress=progress, live_bytes_every=live_bytes_every, print_fn=print_fn,
                                     wandb_project=wandb_project)
        self.print_fn, self.on_step = print_fn or LOG.info, on_step
        self.checkpoint_pieces = tuple(checkpoint_pieces)
        self.step = 0
        self.tokens_seen = 0
        self.checkpointer = None
        if async_save:
            from sp_plan.runtime.async_checkpoint import AsyncCheckpointer

            self.checkpointer = AsyncCheckpointer()
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.calibration = None
        if calibration_csv is not None:
            self.calibration = self._calibration_recorder(calibration_csv, calibration_topology)

    def _calibration_recorder(self, path: str | os.PathLike, topology: Any):
        """The run's calibration recorder; rank 0's refusal (bad path, a plan no row describes) on every rank."""
        from sp_plan.cost_models.hf_config import config_object_dict
        from sp_plan.runtime.calibration_rows import CalibrationRecorder

        setup, problem, recorder = self.setup, None, None
        config = getattr(setup.model, "config", None)
        device = setup.device
        try:
            recorder = CalibrationRecorder(
                path, setup.plan, rank0=self.rank0, topology=topology,
                probed_topology=getattr(setup, "probed_topology", None),
                model_config=config_object_dict(config) if hasattr(config, "to_dict") else None,
                framework="sp-plan Trainer", device_type=device.type,
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                print_fn=self.print_fn)
        except RuntimeConfigError as exc:
            problem = str(exc)
        problem = _broadcast_from_rank0(problem)
        if problem:
            raise RuntimeConfigError(problem)
        return recorder

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Save a checkpoint of the current step under ``checkpoint_dir`` (collective). With ``async_save``
        it returns once the state is staged in host memory and the checkpoint completes in the background
        (:meth:`wait_for_save`)."""
        from sp_plan.runtime.checkpoint import save_checkpoint

        if self.checkpoint_dir is None:
            raise RuntimeConfigError("no checkpoint_dir given")
        save = save_checkpoint if self.checkpointer is None else self.checkpointer.save
        return save(self.checkpoint_dir, step=self.step, setup=self.setup, optimizer=self.optimizer,
                    scheduler=self.scheduler, data=self.data, tokens_seen=self.tokens_seen,
                    keep=self.keep_checkpoints, extra={"run_config": self.run_config}, run_id=self.run_id,
                    log=self._say, pieces=self.checkpoint_pieces)

    def wait_for_save(self) -> None:
        """Block until a background save is complete (no-op without ``async_save``)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def _choose_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (verified, the same on every rank), or None for a new run."""
        from sp_plan.runtime.checkpoint import find_resumable, list_checkpoints, require_verified, resolve_checkpoint

        if self.resume is False or self.resume is None:
            if self.checkpoint_dir is not None:
                existing = _broadcast_from_rank0([p.name for _, p in list_checkpoints(self.checkpoint_dir)]
                                                 if self.rank0 else None)
                if existing:
                    raise RuntimeConfigError(
                        f"checkpoint directory {self.checkpoint_dir} already holds {len(existing)} checkpoint(s) "
                        f"(newest {existing[-1]}) and this run does not resume: it would replace them. Resume them "
                        "(resume=True, --resume), or give a new or empty checkpoint directory")
            return None
        if self.resume is True or self.resume == AUTO:
            path, skipped = find_resumable(self.checkpoint_dir, log=self._say)
            if path is None:
                if not skipped and self.resume == AUTO:
                    self._say(f"resume: no checkpoint under {self.checkpoint_dir}; starting a new run at step 0")
                    return None
                what = (f"none of its {len(skipped)} step director{'y' if len(skipped) == 1 else 'ies'} verifies "
                        f"(see above)" if skipped else "it holds no checkpoint (step_NNNNNNNN directories)"
                        if Path(self.checkpoint_dir).is_dir() else "it does not exist")
                raise RuntimeConfigError(
                    f"cannot resume from {self.checkpoint_dir}: {what}. Check the path (--checkpoint-dir); to start "
                    f"a new run there, drop --resume (resume=False) or use --resume-or-start (resume={AUTO!r})"
                    + (" after moving the damaged directories away" if skipped else ""))
            if skipped:
                self._say(f"resume: falling back to {path}: the newer {', '.join(p.name for p, _ in skipped)} "
                          "did not verify (reasons above)")
            return path
        path = resolve_checkpoint(self.resume)
        require_verified(path)
        return path

    def _resume(self) -> Path | None:
        from sp_plan.runtime.checkpoint import check_checkpoint_dir, load_checkpoint, read_state

        path = self._choose_checkpoint()
        if self.checkpoint_dir is not None:  # before any step runs: not at the first save
            check_checkpoint_dir(self.checkpoint_dir)
        if path is None:
            return None
        saved = read_state(path)
        refused, reported = self._differences(saved)
        if refused and not self.override_hparams:
            raise RuntimeConfigError(
                f"resume from {path}: this run's settings differ from the checkpoint's ({'; '.join(refused)}). "
                "Resume with the checkpoint's values (the saved run's command line), or pass override_hparams=True "
                "(--override-hparams) to continue with this run's (the schedule keeps its step count, its learning "
                "rates rescaled to the new base lr)")
        now = [dict(g) for g in self.optimizer.param_groups] if self.optimizer is not None else []
        state = load_checkpoint(path, setup=self.setup, optimizer=self.optimizer, scheduler=self.scheduler,
                                data=self.data, verify=False,  # verified by _choose_checkpoint
                                pieces=self.checkpoint_pieces)
        if refused:
            self._apply_hparams(now)
            self._say(f"resume: overriding the checkpoint's settings with this run's: {'; '.join(refused)}")
        if reported:
            self._say(f"resume: this run differs from the checkpoint (this run's values apply): {'; '.join(reported)}")
        self.step, self.tokens_seen = state.step, state.tokens_seen
        how = "same layout: exact continuation" if state.same_layout else (
            f"saved on {state.world_size} rank(s) as {_layout_text(state.layout)}, resharded: the loss curve "
            "continues up to float rounding")
        self._say(f"resumed from {state.path} at step {state.step} ({how})")
        return state.path

    def _differences(self, saved: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """(settings that must match unless overridden, settings this run may change) that differ from
        the checkpoint's, as "name: checkpoint X vs now Y"."""
        refused: list[str] = []
        groups = ((saved.get("optimizer") or {}).get("param_groups") or []) if self.optimizer is not None else []
        for i, (old, new) in enumerate(zip(groups, self.optimizer.param_groups if groups else [])):
            where = f" (group {i})" if len(groups) > 1 else ""
            for name in HPARAMS:
                if name == "lr" and "initial_lr" in old and "initial_lr" in new:
                    continue  # the scheduled lr moves; the base lr is what was chosen
                if name in old and name in new and _plain(old[name]) != _plain(new[name]):
                    label = "lr" if name == "initial_lr" else name
                    refused.append(f"{label}{where}: checkpoint {_plain(old[name])} vs now {_plain(new[name])}")
        saved_class = saved.get("scheduler_class")
        if self.scheduler is not None and saved_class and saved_class != type(self.scheduler).__name__:
            refused.append(f"scheduler: checkpoint {saved_class} vs now {type(self.scheduler).__name__}")
        reported = []
        old_config = (saved.get("extra") or {}).get("run_config")
        if isinstance(old_config, dict):
            for name in sorted(set(old_config) | set(self.run_config)):
                if old_config.get(name) != _plain(self.run_config.get(name)):
                    refused.append(f"{name}: checkpoint {old_config.get(name)!r} vs now {self.run_config.get(name)!r}")
        else:
            reported.append("run_config: the checkpoint records none (saved outside the Trainer), not compared")
        if saved.get("world_size") != self.world:
            reported.append(f"world size: checkpoint {saved.get('world_size')} vs now {self.world}")
        layout = self.setup.plan.layout.model_dump(mode="json")
        if saved.get("layout") and saved.get("layout") != layout:
            reported.append(f"layout: checkpoint {_layout_text(saved['layout'])} vs now {_layout_text(layout)}")
        train = self.setup.plan.train.model_dump(mode="json")
        for name in sorted(set(saved.get("train") or {}) | set(train)):
            old_value = (saved.get("train") or {}).get(name)
            if old_value != train.get(name):
                reported.append(f"{name}: checkpoint {old_value!r} vs now {train.get(name)!r}")
        return refused, reported

    def _apply_hparams(self, now: list[dict]) -> None:
        """After loading with ``override_hparams``: this run's hyperparameters in every parameter group; the
        scheduled lr rescaled by new/saved base lr (the schedule's step count is the checkpoint's)."""
        for group, new in zip(self.optimizer.param_groups, now):
            saved_base = _plain(group.get("initial_lr", group.get("lr")))
            for name in HPARAMS:
                if name in new and name != "lr":
                    group[name] = new[name]
            if "initial_lr" in new and saved_base:
                _set_lr(group, _plain(group["lr"]) * _plain(new["initial_lr"]) / saved_base)
            elif "lr" in new:
                _set_lr(group, _plain(new["lr"]))
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [_plain(g.get("initial_lr", g["lr"])) for g in self.optimizer.param_groups]
            self.scheduler._last_lr = [_plain(g["lr"]) for g in self.optimizer.param_groups]

    def _say(self, text: str) -> None:
        if self.rank0:
            self.print_fn(text)

    # -- the loop ------------------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Resume if asked, train up to ``max_steps``, checkpoint; returns a :class:`FitResult`."""
        from sp_plan.runtime.memory_meter import live_peak

        started = time.perf_counter()
        if self.print_fn == LOG.info:
            ensure_logging()  # a script that configured no logging still sees the telemetry (as with print)
        if self.run_id is None:
            self.run_id = _broadcast_from_rank0(secrets.token_hex(6))
        resumed_from = self._resume()
        start_step = self.step
        telemetry = Telemetry(self.setup, total_steps=self.max_steps, start_step=start_step, run_id=self.run_id,
                              **self.telemetry_kwargs)
        if self.rank0 and start_step < self.max_steps:
            telemetry.write(telemetry.mfu_note)
        records: list[StepRecord] = []
        stopped_by, saved = None, None
        nonfinite_in_row = 0
        signals = _ExitSignals() if self.handle_signals else None
        try:
            if signals is not None:
                signals.__enter__()
            while self.step < self.max_steps:
                micro_batches = self.data.next_step()
                lr = _lr(self.optimizer)
                telemetry.begin_step(self.step + 1)
                live = None
                if telemetry.measure_live(self.step + 1):
                    holder: list[StepResult] = []
                    live = live_peak(lambda: holder.append(self._train_step(micro_batches, telemetry.micro_batch_done)),
                                     self.setup.device)
                    result = holder[0]
                else:
                    result = self._train_step(micro_batches, telemetry.micro_batch_done)
                if self.scheduler is not None and not result.skipped:
                    self.scheduler.step()
                self.step += 1
                self.tokens_seen += result.tokens
                nonfinite_in_row = nonfinite_in_row + 1 if result.skipped else 0
                flag = signals.received if signals is not None and signals.received is not None else 0
                reduced = self._reduce_max([flag, *telemetry.local_memory(live)])
                record = telemetry.record(self.step, result, lr, reduced[1:])
                records.append(record)
                if self.calibration is not None and not record.skipped:
                    memory = record.memory
                    self.calibration.record_step(record.step, record.seconds, valid_tokens=record.tokens,
                                                 allocated=memory.get("max_allocated"),
                                                 reserved=memory.get("max_reserved"), rss=memory.get("peak_rss"))
                if self.on_step is not None:
                    self.on_step(self, record)
                if result.skipped:
                    telemetry.write(
                        f"step {self.step}: loss {result.loss:.4g}, gradient norm {result.grad_norm:.4g}: not finite; "
                        f"optimizer step skipped, weights and schedule unchanged ({nonfinite_in_row} in a row, "
                        f"training stops at {self.max_nonfinite_steps})")
                if reduced[0]:
                    stopped_by = signal.Signals(reduced[0]).name
                    telemetry.write(f"{stopped_by} received: stopping after step {self.step}")
                    break
                if nonfinite_in_row >= self.max_nonfinite_steps:
                    stopped_by = "non-finite"
                    telemetry.write(
                        f"stopping after step {self.step}: {nonfinite_in_row} steps in a row had a non-finite loss or "
                        "gradient norm (diverged, or bad data). The weights are those of the last finite step; "
                        "lower the learning rate or clip gradients (max_grad_norm), then resume")
                    break
                if self.checkpoint_dir is not None and self.save_every and self.step % self.save_every == 0:
                    saved = self.save()
            if resumed_from is not None and saved is None and self.step == start_step \
                    and self.checkpoint_dir is not None and resumed_from.parent == self.checkpoint_dir:
                saved = resumed_from  # nothing ran: the checkpoint resumed from is this state
            if self.checkpoint_dir is not None and (saved is None or _step_of(saved) != self.step):
                saved = self.save()
            self.wait_for_save()
            if saved is not None and self.rank0:
                telemetry.write(f"checkpoint: {saved}")
        finally:
            if signals is not None:
                signals.__exit__(None, None, None)
            telemetry.close()
        result = FitResult(start_step=start_step, step=self.step, records=records,
                           seconds=time.perf_counter() - started, stopped_by=stopped_by, checkpoint=saved,
                           resumed_from=resumed_from)
        if self.rank0 and records:
            self.print_fn(summary(result, telemetry.mfu_note))
        if self.calibration is not None:
            try:
                self.calibration.finish()
            except CostModelError as exc:  # the run is done: say the row is lost, do not fail the run for it
                LOG.warning(f"calibration row not written: {exc}")
        return result

    def _train_step(self, micro_batches, on_micro_batch: Callable[[int, int], None] | None = None) -> StepResult:
        return train_step(self.setup, micro_batches, self.optimizer, max_grad_norm=self.max_grad_norm,
                          skip_nonfinite=self.skip_nonfinite, on_micro_batch=on_micro_batch)

    def _reduce_max(self, values: list[int]) -> list[int]:
        if self.world == 1:
            return values
        device = self.setup.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


def summary(result: FitResult, mfu_note: str = "") -> str:
    """Two lines: steps, loss and throughput (steps after the first of this run: it includes warm-up), then
    MFU and peak memory."""
    recs = result.records
    timed = recs[1:] or recs
    seconds = sum(r.seconds for r in timed)
    rate = sum(r.tokens for r in timed) / seconds if seconds else math.nan
    first, last = recs[0].step, recs[-1].step
    lines = [(f"done: {len(recs)} steps in {result.seconds:.1f} s (steps {first}..{last}); loss {recs[0].loss:.3f} -> "
              f"{recs[-1].loss:.3f}; {rate:,.0f} tokens/s (steps {timed[0].step}..{last}, all ranks)")]
    achieved = sum(r.model_flops_per_s * r.seconds for r in timed) / seconds if seconds else math.nan
    parts = [f"model {_flops_text(achieved)} per rank"]
    mfus = [r.mfu for r in timed if r.mfu is not None]
    if mfus:
        parts.append(f"MFU {100 * sum(mfus) / len(mfus):.2f}% {mfu_note.removeprefix('MFU ')}")
    elif mfu_note:
        parts.append(mfu_note)
    mem = {k: max(r.memory.get(k, -1) for r in recs) for k in MEMORY_KEYS}
    if mem["max_allocated"] >= 0:
        parts.append(f"peak {_gb(mem['max_allocated'])} allocated / {_gb(mem['max_reserved'])} reserved "
                     "(max over ranks)")
    elif mem["peak_rss"] >= 0:
        parts.append(f"peak RSS {_gb(mem['peak_rss'])} per process (max over ranks; includes the Python runtime)")
    if mem["live_peak"] >= 0:
        parts.append(f"peak live tensors {_gb(mem['live_peak'])} (profiled steps)")
    if result.skipped_steps:
        parts.append(f"{len(result.skipped_steps)} step(s) skipped, loss or gradients not finite: "
                     + ", ".join(map(str, result.skipped_steps[:10])) + (" ..." if len(result.skipped_steps) > 10 else ""))
    if result.stopped_by:
        parts.append(f"stopped by {result.stopped_by}")
    if parts:
        lines.append("telemetry: " + " | ".join(parts))
    return "\n".join(lines)


def _lr(optimizer) -> float | None:
    try:
        lr = optimizer.param_groups[0]["lr"]
    except (AttributeError, IndexError, KeyError):
        return None
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _plain(value: Any) -> Any:
    """A hyperparameter as JSON saw it: tensors as numbers, tuples as lists."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _set_lr(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


def _layout_text(layout: dict) -> str:
    parts = [f"{k}={v}" for k, v in layout.items() if isinstance(v, int) and v > 1]
    return " x ".join(parts) or "1 rank"


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
