"""The options of one ``sp-plan train`` run, and the constants of its default data: torch-free, so the
command line can parse and check them (and ``sp-plan train --help`` can run) without importing torch.

:class:`TrainRunOptions` is what :func:`sp_plan.runtime.train_run.run_training` takes; the CLI builds one
from its flags, and code can build one directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sp_plan.cost_models import degrees

#: Byte-level tokenizer: 256 byte values plus these special tokens.
PAD, BOS, EOS = 256, 257, 258
VOCAB = 259
#: Corpus size cap: plenty for a few dozen steps, and quick to read on every rank.
DEFAULT_CORPUS_BYTES = 8 << 20
WARMUP_STEPS = 5

#: Memory techniques the command line can pin (the layout degrees come from the registry,
#: :mod:`sp_plan.cost_models.degrees`).
TECHNIQUE_PINS = ("tiled_mlp", "tiled_loss", "offload_checkpoints", "offload_optimizer", "offload_params")

#: Predicted run time (hours) above which a run starts only when told to (``--yes``): an hour on CPU, where
#: runs are demos and tests, a week on GPUs. ``--max-predicted-hours`` replaces the bound.
PREDICTED_HOURS_LIMIT = {"cpu": 1.0, "gpu": 7 * 24.0}

#: Exit code of a run stopped by a signal: the shell's convention, 128 + the signal number (SIGTERM: 143,
#: SIGINT: 130), so a scheduler does not take a preempted run for a finished one.
SIGNAL_EXIT_BASE = 128
#: Exit code of a run that stopped on a non-finite loss: a diverged job must not look successful.
DIVERGED_EXIT_CODE = 3


@dataclass(frozen=True)
class TrainRunOptions:
    """Everything one run takes; the defaults are the command line's (``sp-plan train --help`` says what each
    does). ``None`` for a pin means "the planner decides"; the model shape is ignored with ``plan``."""

    plan: str | None = None
    seq_len: int = 2048
    steps: int = 30
    micro_batch: int = 1
    global_batch: int | None = None
    lr: float = 2e-3
    seed: int = 0
    dtype: str | None = None
    topology: str | None = None
    # model (ignored with a plan)
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 352
    hf: bool = False
    #: A Hugging Face config.json (or its folder): train that transformers architecture instead of the shape
    #: above (any family the runtime drives, MoE and MLA included); with ``plan``, the plan's layout and options.
    model_config: Path | None = None
    # layout and options the planner must use (ignored with a plan)
    sp_only: bool = True
    #: Pinned layout degrees (every registered degree has a flag); the rest the planner decides.
    layout_pins: Mapping[str, int] = field(default_factory=dict)
    checkpointing: str | None = None
    zero_stage: int | None = None
    tiled_mlp: bool | None = None
    tiled_loss: bool | None = None
    offload_checkpoints: bool | None = None
    offload_optimizer: bool | None = None
    offload_params: bool | None = None
    # data
    dataset: str | None = None
    tokenizer: str | None = None
    text_column: str = "text"
    split: str = "train"
    positions: str = "continuous"
    #: How a --dataset's documents become rows (:mod:`sp_plan.cost_models.packing`); None: the loaded plan's
    #: data shape's packing, else ``stream``.
    packing: str | None = None
    #: How the ring splits a row: ``auto`` (None: the plan's choice), ``zigzag`` or ``per_document``.
    sharding: str | None = None
    data_cache: Path | None = None
    corpus: Path | None = None
    corpus_bytes: int = DEFAULT_CORPUS_BYTES
    # checkpoints and telemetry
    checkpoint_dir: Path | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    async_save: bool = False
    resume: bool = False
    resume_or_start: bool = False
    override_hparams: bool = False
    tensorboard: Path | None = None
    metrics_file: Path | None = None
    log_every: int = 10
    wandb_project: str | None = None
    #: Append the run's row for ``sp-plan calibrate`` to this CSV (rank 0; :mod:`sp_plan.runtime.calibration_rows`).
    record_calibration: Path | None = None
    live_bytes_every: int = 0
    progress: bool = True
    # how long a run may be predicted to take before it needs ``yes`` (see train_run.check_predicted_duration)
    max_predicted_hours: float | None = None
    yes: bool = False

    def conflicts(self) -> list[str]:
        """Option combinations that cannot run, as the messages the command line shows (before any work)."""
        found = []
        if (self.dataset is None) != (self.tokenizer is None):
            found.append("--dataset and --tokenizer go together (the default corpus is byte-level)")
        if self.async_save and self.checkpoint_dir is None:
            found.append("--async-save needs --checkpoint-dir")
        if (self.resume or self.resume_or_start) and self.checkpoint_dir is None:
            found.append("--resume and --resume-or-start need --checkpoint-dir")
        if self.resume and self.resume_or_start:
            found.append("--resume and --resume-or-start exclude each other")
        if self.save_every and self.checkpoint_dir is None:
            found.append("--save-every needs --checkpoint-dir")
        found += self.data_conflicts()
        return found

    @property
    def per_document_positions(self) -> bool:
        """Whether rows restart positions per document (the CLI spells it ``per-document``)."""
        return self.positions.replace("-", "_") == "per_document"

    def data_conflicts(self) -> list[str]:
        """Packing and sharding flags that cannot shape this run's rows."""
        found = []
        given = [flag for flag, value in (("--packing", self.packing), ("--sharding", self.sharding)) if value]
        if given and self.dataset is None:
            verb = "shape" if len(given) > 1 else "shapes"
            found.append(f"{' and '.join(given)} {verb} the rows of a --dataset (the default corpus is cut into "
                         "fixed windows): add --dataset and --tokenizer, or drop them")
        if self.sharding == "per_document" and not self.per_document_positions:
            found.append("--sharding per_document splits every document of a row over the ring ranks, so it needs "
                         "the rows' document boundaries: add --positions per-document (or use --sharding zigzag)")
        return found

    def pins_given(self) -> bool:
        """Whether any layout degree or option is pinned (then a resumed checkpoint's plan is not reused)."""
        names = ("checkpointing", "zero_stage", *TECHNIQUE_PINS)
        return bool(self.layout_pins) or any(getattr(self, k) is not None for k in names)

    def __getattr__(self, name: str) -> int | None:
        # ``options.ulysses`` and the like: a registered degree's pin, None when the planner decides
        if name in (*degrees.registered(), "ep"):
            return self.layout_pins.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
