"""One training run of sp-plan's own runtime, from a plan file or from pins: what ``sp-plan train`` runs.

The options arrive as a :class:`TrainRunOptions` (no click here: the runtime never imports the CLI);
``sp_plan.cli.commands.train`` parses the command line into one, and ``examples/train_long_context.py``
is a thin wrapper over that command. :func:`run_training` builds the model (the runtime's Llama, or with
``hf`` a transformers Llama of the same shape), plans or loads the plan through
:func:`~sp_plan.runtime.auto.auto_configure`, builds the data stream (by default byte-level tokens of this
Python's standard library, no download; or a Hugging Face text dataset packed to the planned sequence
length) and hands everything to :class:`~sp_plan.runtime.trainer.Trainer`.
"""

from __future__ import annotations

import os
import signal
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from sp_plan.cost_models import degrees
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.planner.plan import Plan, load_plan, plan_from_dict
from sp_plan.runtime.auto import AutoConfigured, auto_configure
from sp_plan.runtime.checkpoint import list_checkpoints, read_verified_state
from sp_plan.runtime.data import TokenWindows
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.host_overhead import add_measured_host_overhead
from sp_plan.runtime.host_ram import INIT_BYTES_PER_PARAM, available_host_bytes
from sp_plan.runtime.log import ensure_logging, get_logger
from sp_plan.runtime.mesh import check_launch
from sp_plan.runtime.models import LlamaModel
from sp_plan.runtime.models.base import refuse_unbuildable
from sp_plan.runtime.planning import refuse_unsupported
from sp_plan.runtime.text_data import GlobalBatches
from sp_plan.runtime.train_options import (
    BOS,
    DIVERGED_EXIT_CODE,
    EOS,
    PAD,
    PREDICTED_HOURS_LIMIT,
    SIGNAL_EXIT_BASE,
    TECHNIQUE_PINS,
    VOCAB,
    WARMUP_STEPS,
    TrainRunOptions,
)
from sp_plan.runtime.trainer import FitResult, Trainer

LOG = get_logger(__name__)


def read_corpus(root: Path | None, limit: int) -> torch.Tensor:
    """Byte tokens of every .py file under ``root`` (sorted), each as BOS + bytes + EOS, up to ``limit``."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts)
    if not files:
        raise RuntimeConfigError(f"no .py files under {root}: pass --corpus DIR")
    chunks, total = [], 0
    for file in files:
        data = file.read_bytes()
        if not data:  # empty __init__.py files
            continue
        piece = torch.cat([torch.tensor([BOS]), torch.frombuffer(bytearray(data), dtype=torch.uint8).long(),
                           torch.tensor([EOS])])
        chunks.append(piece)
        total += piece.numel()
        if total >= limit:
            break
    return torch.cat(chunks)[:limit]


def tokenizer_vocabulary(options: TrainRunOptions) -> tuple[int, int]:
    """(vocabulary size, padding id) of the run's tokenizer: the byte-level one, or ``options.tokenizer``."""
    if options.tokenizer is None:
        return VOCAB, PAD
    from sp_plan.runtime.text_data import check_dataset_source, load_tokenizer  # transformers: lazy

    check_dataset_source(options.dataset)  # fail before the slow parts
    tokenizer = load_tokenizer(options.tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return len(tokenizer), pad


def build_model(options: TrainRunOptions, plan: Plan | None, vocab: int) -> nn.Module:
    """The model to train: the options' HF config.json, else the plan's architecture, else the options' shape;
    seeded random weights."""
    if options.model_config is not None:
        model = build_configured_hf_model(options, vocab)
        if plan is not None:
            refuse_other_model(plan, model, options.model_config)
        return model
    if plan is not None:
        spec = plan.model
    else:
        prefix = "byte-llama" if options.tokenizer is None else "llama"
        spec = ModelSpec(name=f"{prefix}-{options.layers}x{options.hidden}", num_layers=options.layers,
                         hidden_size=options.hidden, num_heads=options.heads, num_kv_heads=options.kv_heads,
                         head_dim=options.hidden // options.heads, ffn_hidden_size=options.ffn, vocab_size=vocab)
    if spec.vocab_size < vocab:
        raise RuntimeConfigError(f"the plan's model has a vocabulary of {spec.vocab_size}; the tokenizer needs {vocab}")
    refuse_unbuildable(spec, options.seq_len)  # a window or Gemma's norms would train another model
    torch.manual_seed(options.seed)
    if options.hf:
        return build_hf_model(spec, options.seq_len)
    model = LlamaModel(spec)
    model.init_weights(generator=torch.Generator().manual_seed(options.seed))
    return model


def refuse_other_model(plan: Plan, model: nn.Module, path: Path) -> None:
    """A --model file that is not the plan's model would train an architecture the plan never sized."""
    from sp_plan.runtime.models.hf.model import hf_model_spec  # transformers: lazy

    problem = plan.model.other_model_problem(hf_model_spec(model), f"--model {str(path)!r}")
    if problem:
        raise RuntimeConfigError(problem)


def build_configured_hf_model(options: TrainRunOptions, vocab: int) -> nn.Module:
    """The transformers model of ``options.model_config`` (random weights, seeded), its vocabulary checked."""
    torch.manual_seed(options.seed)
    try:
        from sp_plan.runtime.models.hf.model import hf_model_from_config_file  # transformers: lazy

        model = hf_model_from_config_file(options.model_config)
    except ImportError as exc:
        raise RuntimeConfigError("--model needs transformers: pip install 'sp-plan[hf]'") from exc
    if model.config.vocab_size < vocab:
        raise RuntimeConfigError(f"{options.model_config}: vocab_size {model.config.vocab_size} is smaller than the "
                                 f"tokenizer's {vocab}; raise vocab_size in the config to at least {vocab}")
    return model


def build_hf_model(spec: ModelSpec, seq_len: int) -> nn.Module:
    """A transformers causal LM with ``spec``'s architecture and random weights (seeded by the caller)."""
    try:
        from sp_plan.runtime.models.hf.model import hf_model_from_spec  # transformers: lazy

        return hf_model_from_spec(spec, seq_len)
    except ImportError as exc:
        raise RuntimeConfigError("--hf needs transformers: pip install 'sp-plan[hf]'") from exc


def checkpoint_plan(options: TrainRunOptions) -> Plan | None:
    """The plan of the checkpoint a resume will load, when this launch may reuse it: no plan file, no pins,
    the same number of ranks. Re-planning could pick another layout on a noisy probe."""
    if not (options.resume or options.resume_or_start) or options.plan or options.pins_given():
        return None
    # The newest checkpoint whose bookkeeping matches its manifest (the Trainer then verifies every file of
    # the one it resumes from, and may fall back further: the same run's plan).
    for _, path in reversed(list_checkpoints(options.checkpoint_dir)):
        try:
            state = read_verified_state(path)
            break
        except RuntimeConfigError:
            continue
    else:
        return None
    if state.get("world_size") != int(os.environ.get("WORLD_SIZE", "1")) or not state.get("plan"):
        return None
    return plan_from_dict(state["plan"], f"the plan saved in {path}")


def dataset_packing(options: TrainRunOptions, plan: Plan | None) -> str:
    """How the run's documents become rows: ``--packing``, else the packing the plan was priced on (its data
    shape's), else ``stream`` (what every earlier version trained on)."""
    if options.packing is not None:
        return options.packing
    data = plan.train.data if plan is not None else None
    return data.packing if data is not None else "stream"


def build_text_dataset(options: TrainRunOptions, seq_len: int, packing: str, multiple: int = 1):
    """The --dataset packed into rows of ``seq_len`` (collective: rank 0 builds or reuses the cache)."""
    from sp_plan.runtime.text_data import PackedTextDataset  # datasets: lazy

    log = LOG.info if not dist.is_initialized() or dist.get_rank() == 0 else None
    return PackedTextDataset.build(options.dataset, options.tokenizer, seq_len, text_column=options.text_column,
                                   split=options.split, positions=options.positions.replace("-", "_"),
                                   packing=packing, multiple=multiple, cache_dir=options.data_cache, log=log)


def planning_data(options: TrainRunOptions, packing: str):
    """What the planner prices a --dataset run on when it plans here: the dataset's recorded document lengths
    with the packing and ``--sharding`` (:class:`~sp_plan.cost_models.data_balance.DataShape`), and the dataset
    packed to read them (reused when the plan needs no other rows). Only for per-document positions: with
    continuous positions attention crosses the documents of a row, so the planner prices whole rows (no data
    shape) and the ring splits them zigzag. ``(None, None)`` when there is nothing to price."""
    if options.dataset is None or not options.per_document_positions:
        return None, None
    from sp_plan.cost_models.data_balance import DataShape
    from sp_plan.runtime.distributed import init_distributed

    init_distributed()  # the dataset is built once, by rank 0, before the planning
    dataset = build_text_dataset(options, options.seq_len, packing)
    histogram = dataset.lengths()
    if histogram is None:  # build() records them; only a cache edited by hand lacks them
        raise RuntimeConfigError(f"{dataset.directory} holds no document lengths: delete it to rebuild")
    shape = DataShape(bins=histogram.bins, packing=packing, sharding=options.sharding or "auto",
                      source=str(options.dataset))
    return shape, dataset


def check_plan_data(plan: Plan, options: TrainRunOptions) -> None:
    """A loaded plan fixes the ring's sharding rule (its data shape's, as priced): refuse a ``--sharding`` that
    asks for another, and per-document sharding of rows without document boundaries."""
    from sp_plan.runtime.planning import sharding_choice

    rule, how = sharding_choice(plan)
    if options.sharding not in (None, "auto", rule):
        raise RuntimeConfigError(f"--sharding {options.sharding}, but the plan shards rows {rule} ({how}): drop "
                                 f"--sharding, or re-plan with sp-plan plan --lengths ... --sharding {options.sharding}")
    if rule == "per_document" and plan.layout.ring > 1 and not options.per_document_positions:
        raise RuntimeConfigError(f"the plan shards rows per_document ({how}), which needs the rows' document "
                                 "boundaries: add --positions per-document (or re-plan with --sharding zigzag)")


def row_multiple(setup: AutoConfigured, packing: str) -> int:
    """What whole-document rows round every document to: 2 x ring under per-document ring sharding (the
    planner priced the rows packed so; the sharder then adds no padding), else 1. Stream rows are cut at
    ``seq_len``, so the sharder pads their documents itself."""
    ring = setup.layout.ring
    return 2 * ring if packing != "stream" and setup.sp.sharding == "per_document" and ring > 1 else 1


def make_data(options: TrainRunOptions, setup: AutoConfigured, packing: str = "stream",
              dataset=None) -> tuple[GlobalBatches, str, str]:
    """This rank's resumable batch stream, a line describing the data and the layout line (packing, sharding,
    padding, rows). ``dataset``: the --dataset rows already built for planning, used when the plan needs no
    other rows."""
    train = setup.train
    if options.dataset is None:
        tokens = read_corpus(options.corpus, options.corpus_bytes)
        dataset = TokenWindows(tokens, train.seq_len)
        what = (f"{tokens.numel():,} byte tokens of Python stdlib source, {len(dataset)} sequences of "
                f"{train.seq_len:,}")
        padding, packing, multiple = 0.0, "windows of the byte corpus", 1
    else:
        from sp_plan.runtime.text_data import check_vocabulary  # datasets: lazy

        multiple = row_multiple(setup, packing)
        if dataset is None or dataset.meta.get("multiple", 1) != multiple:  # the plan needs other rows
            dataset = build_text_dataset(options, train.seq_len, packing, multiple)
        check_vocabulary(dataset, setup.plan.model.vocab_size)
        if dataset.positions == "per_document":  # refused up front if the runtime cannot train such rows
            try:
                setup.sharder.prepare({k: v.unsqueeze(0) for k, v in dataset[0].items()})
            except RuntimeConfigError as exc:
                raise RuntimeConfigError(f"{exc} (this example: --positions continuous)") from None
        what = dataset.describe()
        padding = dataset.padding_fraction
    data = GlobalBatches.for_setup(setup, dataset, seed=options.seed)
    if data.sequences_per_step > len(dataset):
        raise RuntimeConfigError(
            f"the data gives {len(dataset)} sequences, fewer than one step of {data.sequences_per_step}: use a shorter "
            "--seq-len or more data"
        )
    line = (f"data: {what}; {setup.dp_size} data-parallel group(s); {train.grad_accum} micro-batch(es) of "
            f"{train.micro_batch} per step")
    return data, line, layout_line(setup, packing, padding, len(dataset), multiple)


def layout_line(setup: AutoConfigured, packing: str, padding: float, rows: int, multiple: int = 1) -> str:
    """The run's one line on how rows are made and split: the packing, the ring's sharding rule and why, the
    rows' padding (beside the planner's estimate from its sample of the lengths) and their number."""
    from sp_plan.cost_models.data_balance import layout_balance
    from sp_plan.runtime.planning import sharding_choice

    plan = setup.plan
    rule, how = sharding_choice(plan)
    balance = layout_balance(plan.model, plan.train, plan.layout)
    priced = (f"; planned on the dataset's lengths: {balance.padding_fraction:.1%} padding predicted"
              if balance is not None else "; planned on whole rows")
    rounded = f", documents rounded up to multiples of {multiple}" if multiple > 1 else ""
    return (f"packing {packing}, sharding {rule} ({how}), padding {padding:.1%} of {rows:,} rows of "
            f"{setup.train.seq_len:,} tokens{rounded}{priced}")


def _duration(hours: float) -> str:
    """``hours`` in the unit a person reads it in: seconds, minutes, hours or days."""
    for unit, size in (("day", 24.0), ("hour", 1.0), ("minute", 1 / 60)):
        if hours >= (2 * size if unit == "day" else size):
            value = hours / size
            break
    else:
        unit, value = "second", hours * 3600
    text = f"{value:,.3g}" if value < 1000 else f"{value:,.0f}"
    return f"{text} {unit}{'' if text == '1' else 's'}"


def predicted_duration_problem(plan: Plan, steps: int, device_type: str, max_hours: float | None = None,
                               planned_here: bool = True) -> str | None:
    """Why a run must not start unasked, or None: the plan's predicted step time x ``steps`` exceeds
    ``max_hours`` (default :data:`PREDICTED_HOURS_LIMIT` for the device type). A typo in a batch size can
    turn a minute's demo into days of a machine; the message names the prediction and how to shrink it.
    A plan without a time estimate is not judged."""
    step_s = ((plan.estimate or {}).get("time") or {}).get("step_s")
    if not step_s or step_s <= 0:
        return None
    limit = max_hours if max_hours is not None else PREDICTED_HOURS_LIMIT["cpu" if device_type == "cpu" else "gpu"]
    hours = step_s * steps / 3600
    if hours <= limit:
        return None
    t = plan.train
    tokens = t.seq_len * t.micro_batch * t.grad_accum * plan.layout.dp
    where = "a CPU run" if device_type == "cpu" else "a GPU run"
    bound = (f"--max-predicted-hours {max_hours:g}" if max_hours is not None
             else f"the {_duration(limit)} bound for {where}")
    if planned_here:
        shrink = ("fewer --steps, a smaller --global-batch (sequences per step), a shorter --seq-len or a smaller "
                  "model")
    else:
        shrink = ("fewer --steps, or a plan for a smaller global batch (sp-plan plan --global-batch-tokens ...) or "
                  "shorter sequences")
    per_step = f"{step_s:,.3g}" if step_s < 1000 else f"{step_s:,.0f}"
    return (f"the plan predicts {per_step} s per step on {plan.hardware.topology} ({tokens:,} tokens per step: "
            f"{t.seq_len:,} x micro-batch {t.micro_batch} x grad-accum {t.grad_accum} x {plan.layout.dp} "
            f"data-parallel), so {steps:,} steps take about {_duration(hours)}, over {bound}. To run it anyway "
            f"pass --yes (or raise --max-predicted-hours); to shrink it: {shrink}")


def check_predicted_duration(options: TrainRunOptions, setup: AutoConfigured, planned_here: bool) -> None:
    """Refuse (before any data is read or step is taken) a run predicted to take far longer than meant,
    unless ``options.yes``; :func:`predicted_duration_problem` says when and why."""
    if options.yes:
        return
    problem = predicted_duration_problem(setup.plan, options.steps, setup.device.type, options.max_predicted_hours,
                                         planned_here)
    if problem:
        raise RuntimeConfigError(problem)


def configure(options: TrainRunOptions, model: nn.Module, plan: Plan | None, pad: int,
              data=None) -> AutoConfigured:
    """Set the model up for the plan, or (no plan) plan for this machine under the options' pins, pricing
    ``data`` (the dataset's :class:`~sp_plan.cost_models.data_balance.DataShape`); the ring shards rows by the
    plan's rule (:func:`sp_plan.runtime.planning.sharding_choice`)."""
    if plan is not None:
        return auto_configure(model, plan=plan, pad_token_id=pad, sharding=None)
    pins = dict(options.layout_pins)
    if options.sp_only:  # every rank splits the sequence: all other degrees at 1
        for dim in degrees.without_role("sequence"):
            pins.setdefault(dim, 1)
    fixed = {k: getattr(options, k) for k in ("checkpointing", "zero_stage", *TECHNIQUE_PINS)
             if getattr(options, k) is not None}
    return auto_configure(model, seq_len=options.seq_len, micro_batch=options.micro_batch, dtype=options.dtype,
                          global_batch=options.global_batch, topology=options.topology, fixed_layout=pins,
                          fixed_options=fixed, pad_token_id=pad, data=data, sharding=None)


def refuse_unbuildable_on_host(plan: Plan, local_ranks: int, available: int | None, on_gpus: bool = False) -> None:
    """Refuse a plan whose model the ranks of this host cannot even build: each rank builds it whole in fp32 in
    host memory before sharding it, on CPU and GPU ranks alike, and the kernel's OOM kill would leave only a bare
    SIGKILL behind."""
    need = plan.model.num_params * INIT_BYTES_PER_PARAM * local_ranks
    if available is None or need <= available:
        return
    ranks = f"{local_ranks} {'GPU' if on_gpus else 'CPU'} rank(s) on this host"
    fix = ("fewer ranks per host (torchrun --nproc-per-node) on more hosts, or a smaller model: the runtime builds "
           "the whole model in host memory before sharding it" if on_gpus else
           "train this plan on GPUs, or a smaller model on this machine (sp-plan train without --plan, or a plan for "
           "a smaller config.json)")
    raise RuntimeConfigError(
        f"{ranks} would each build {plan.model.name} ({plan.model.num_params / 1e9:.2f}B parameters, "
        f"{need / 1e9:.1f} GB in fp32 together) but {available / 1e9:.1f} GB of host RAM is available: {fix}")


def refuse_plan_before_building(plan: Plan, options: TrainRunOptions) -> None:
    """The plan checks that need no model, run before the model is built: a plan for 8 GPUs (an 8B model) started
    as one process, or a prefill plan, was refused only after the whole unsharded model was allocated, which on a
    CPU box ended in the kernel's OOM kill instead of the one-line reason."""
    refuse_launch_before_building(plan)
    refuse_unsupported(plan, "hf" if options.hf or options.model_config is not None else "llama")


def refuse_launch_before_building(plan: Plan) -> None:
    """The checks of this launch that need no model (``sp-plan train --plan`` and ``sp-plan validate``): the rank
    count against the plan's world, and a model this host's ranks cannot build in fp32."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    # device "cpu": only the rank-count check applies here; the GPU checks run when the mesh is built
    check_launch(plan.layout, world, device_type="cpu", local_world_size=world, visible_devices=0)
    refuse_unbuildable_on_host(plan, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), available_host_bytes(),
                               on_gpus=torch.cuda.is_available())


def run_training(options: TrainRunOptions,
                 on_finish: Callable[[AutoConfigured, FitResult, int], None] | None = None) -> int:
    """Run the training; the process exit code (0, or :data:`DIVERGED_EXIT_CODE` on a non-finite loss).

    ``on_finish(setup, result, code)``, when given, is called on every rank once the run ended (the plan that ran,
    the trainer's :class:`~sp_plan.runtime.trainer.FitResult` and the exit code): ``sp-plan train --json`` prints
    its summary from there.

    Raises :class:`~sp_plan.runtime.errors.RuntimeConfigError` (and the planner's errors) for runs that
    cannot start; the caller ends the torchrun worker (:func:`~sp_plan.runtime.distributed.finish_worker`).
    """
    ensure_logging()  # the example script reaches here without the CLI's set-up
    problems = options.conflicts()
    if problems:
        raise RuntimeConfigError("; ".join(problems))
    if options.record_calibration is not None and int(os.environ.get("RANK", "0") or 0) == 0:
        from sp_plan.runtime.calibration_rows import check_record_path

        check_record_path(options.record_calibration)  # before anything is built (the Trainer checks the rest)
    vocab, pad = tokenizer_vocabulary(options)
    plan = load_plan(options.plan) if options.plan else None
    reused = checkpoint_plan(options) if plan is None else None
    if plan is not None:
        refuse_plan_before_building(plan, options)
    given = plan or reused
    if given is not None:
        check_plan_data(given, options)
    packing = dataset_packing(options, given)
    model = build_model(options, given, vocab)
    shape, first_rows = planning_data(options, packing) if given is None else (None, None)
    setup = configure(options, model, given, pad, shape)
    rank0 = dist.get_rank() == 0
    if rank0:
        LOG.info("\n".join(setup.describe()))
        if reused is not None:
            LOG.info("  (the plan of the checkpoint being resumed)")
    check_predicted_duration(options, setup, planned_here=plan is None and reused is None)
    if setup.device.type == "cpu" and plan is None and reused is None and options.topology is None:
        # CPU ranks: the step's host cost, measured at a short length (runtime/host_overhead.py)
        if add_measured_host_overhead(setup, options.seed) is not None and rank0:
            LOG.info(f"note: {setup.notes[-1]}")
    data, data_line, rows_line = make_data(options, setup, packing, first_rows)
    if rank0:
        LOG.info(data_line)
        LOG.info(rows_line)
    optimizer = setup.make_optimizer(lr=options.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    trainer = Trainer(setup, optimizer, data, max_steps=options.steps, scheduler=schedule, max_grad_norm=1.0,
                      checkpoint_dir=options.checkpoint_dir, save_every=options.save_every,
                      keep_checkpoints=options.keep_checkpoints,
                      resume="auto" if options.resume_or_start else options.resume,
                      override_hparams=options.override_hparams,
                      run_config={"warmup_steps": WARMUP_STEPS, "seed": options.seed}, log_every=options.log_every,
                      tensorboard_dir=options.tensorboard, metrics_file=options.metrics_file,
                      progress=options.progress, live_bytes_every=options.live_bytes_every,
                      async_save=options.async_save, handle_signals=True, wandb_project=options.wandb_project,
                      calibration_csv=options.record_calibration, calibration_topology=options.topology)
    result = trainer.fit()
    code = exit_code(result)
    if result.stopped_by in ("SIGTERM", "SIGINT") and rank0:
        LOG.info(stopped_line(result, options))
    if on_finish is not None:
        on_finish(setup, result, code)
    return code


def exit_code(result: FitResult) -> int:
    """The process exit code of a finished run: 0, :data:`DIVERGED_EXIT_CODE` after non-finite losses, or
    128 + the signal that stopped it."""
    if result.stopped_by == "non-finite":
        return DIVERGED_EXIT_CODE
    if result.stopped_by in ("SIGTERM", "SIGINT"):
        return SIGNAL_EXIT_BASE + signal.Signals[result.stopped_by].value
    return 0


def stopped_line(result: FitResult, options: TrainRunOptions) -> str:
    """The one line a run stopped by a signal ends with: where it stopped and how it continues."""
    if result.checkpoint is None:
        return (f"stopped by {result.stopped_by} after step {result.step}; nothing saved (no --checkpoint-dir): "
                "pass --checkpoint-dir to make a run resumable")
    return (f"stopped by {result.stopped_by} after step {result.step}; checkpoint {result.checkpoint} saved: "
            f"continue with --resume --checkpoint-dir {options.checkpoint_dir}")
