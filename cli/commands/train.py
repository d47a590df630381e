"""``sp-plan train``: train with sp-plan's own runtime, from a plan file or planning in place.

Meant to run under torchrun, one process per GPU (gloo ranks on CPU), as ``sp-plan export --to torchrun``
prints it::

    torchrun --standalone --nproc-per-node 4 -m sp_plan.cli train --plan plan.yaml

or launching its ranks itself, ``sp-plan train --nproc-per-node 4 --plan plan.yaml`` (torchrun's launcher
in-process): then a SIGTERM (preemption) or SIGINT to the launcher stops every rank after its current
step, saves a checkpoint (with ``--checkpoint-dir``) and exits 143 (130) with the ranks' one line and no
launcher traceback (torchrun itself ends such a run in a ``SignalException`` traceback).

With ``--json`` the run's summary (:func:`run_summary`: the plan, the steps, their losses, tokens/s, the checkpoint
and why the run ended) is the only thing on stdout, one JSON object printed by rank 0 at the end; the log lines
go to stderr.

Without ``--plan``, rank 0 plans for the probed machine (or ``--topology``) under the layout and option
pins, and every rank checks it holds the same plan. The run itself is
:func:`sp_plan.runtime.train_run.run_training`; torch and the runtime are imported only when the command
runs, so ``sp-plan --help`` stays torch-free. Every rank parses the same command line, so a bad option
is reported once per node (by local rank 0; the other ranks exit with the same code, silently) instead of
once per rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from sp_plan.cost_models import degrees
from sp_plan.cost_models.json_io import finite_or_null, strict_dumps
from sp_plan.cost_models.layout import MAX_DEGREE
from sp_plan.cost_models.packing import PACKINGS
from sp_plan.runtime.train_options import DEFAULT_CORPUS_BYTES, TECHNIQUE_PINS, TrainRunOptions

from .common import SEQ_LEN, FiniteFloatRange

#: ``--sharding``: the rules the runtime runs, and ``auto`` (as ``sp-plan plan --sharding``).
RUNTIME_SHARDING_CHOICES = ("auto", "zigzag", "per_document")

#: Bound on the built-in model's sizes: far above a CPU run, and refuses 0 and negatives in one line.
MODEL_SIZE = click.IntRange(1, 1 << 20)


def reports_errors() -> bool:
    """Whether this process prints command-line errors: outside torchrun always; under it local rank 0 only
    (once per node, so every node's log says why its ranks stopped)."""
    rank = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    return rank.strip() in ("", "0")


#: How long a silent rank waits before it exits on an error every rank hits. torchrun stops all ranks as soon
#: as one exits with an error; a silent rank that exits first can have the reporting rank killed before it has
#: printed why (seen on a loaded 2-core CI machine). Waiting lets the reporting rank exit first, and torchrun
#: then ends the waiting ranks at once, so a failing launch is not slower by this much.
SILENT_RANK_GRACE_S = 30.0


def fail_once(exc: click.ClickException) -> NoReturn:
    """Show a command-line error on the reporting rank only, and exit every rank with its code (2)."""
    if reports_errors():
        exc.show()
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        time.sleep(SILENT_RANK_GRACE_S)
    raise click.exceptions.Exit(exc.exit_code)


#: Where the command keeps its raw arguments (``--nproc-per-node`` passes them on to the ranks it launches).
ARGV_KEY = "sp_plan.train.argv"
#: Launcher environment variables: set inside a torchrun (or ``--nproc-per-node``) worker.
LAUNCHED_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


class TrainCommand(click.Command):
    """A command whose parsing errors (unknown option, bad value) are printed by one rank per node."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        argv = list(args)
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            fail_once(exc)
        ctx.meta[ARGV_KEY] = argv
        return ctx


def worker_argv(argv: list[str]) -> list[str]:
    """The command line the launched ranks run: ``argv`` without ``--nproc-per-node N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def launch_ranks(nproc: int, argv: list[str]) -> int:
    """Run ``sp-plan train argv`` on ``nproc`` local ranks under torchrun's launcher (``--standalone``), in
    this process, and return the exit code: 0; 128 + the signal when a SIGTERM/SIGINT stopped the run (the
    ranks stop after their step, save and say where; the launcher adds no traceback); else the first
    failed rank's code, named in one line (the rank printed its reason above it)."""
    if any(os.environ.get(k) for k in LAUNCHED_ENV):
        fail_once(click.UsageError("--nproc-per-node launches the ranks itself: drop it under torchrun (or run "
                                   "without torchrun)"))
    import logging

    quiet = "LOGLEVEL" not in os.environ  # torchrun's own warnings (signals sent, OMP threads): not for users
    os.environ.setdefault("LOGLEVEL", "ERROR")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if quiet:  # its "failed (exitcode: -9) local_rank: 1" line too: the one line below names the rank and why
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "sp_plan.cli", "train",
                       *worker_argv(argv)])
    try:
        run(args)
    except SignalException as exc:  # the ranks got the signal from the launcher, stopped and said so
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        # A rank killed by a signal is the cause: its peers fail after it (a lost connection), and one of them
        # may exit before the launcher has seen the dead rank, so it would be "first".
        # The launcher stops the survivors with SIGTERM once it sees a dead rank, so a rank that got SIGTERM is
        # a casualty when another died of some other signal (seen on a loaded machine: rank 0's SIGTERM was
        # recorded beside rank 1's SIGKILL).
        killed = sorted(((r, f) for r, f in exc.failures.items() if f.exitcode < 0),
                        key=lambda item: (item[1].exitcode == -signal.SIGTERM, item[0]))
        if killed:
            rank, failure = killed[0]
        code = failure.exitcode
        if code < 0:  # killed by a signal
            name = signal.Signals(-code).name
            click.echo(f"error: rank {rank} was killed by {name}", err=True)
            return 128 - code
        if code >= 128 and code - 128 in {s.value for s in signal.Signals}:
            return code  # stopped by a signal it received directly, and said so
        click.echo(f"error: rank {rank} exited with code {code} (its message is above)", err=True)
        return code
    return 0


def _pin_options(func):
    """A pin per layout degree (--tp .. --dp-replicate), --checkpointing, --zero and the --x/--no-x technique pins
    (all optional)."""
    for dim in reversed(degrees.innermost_first()):
        func = click.option(degrees.degree(dim).flag, dim, type=click.IntRange(1, MAX_DEGREE), default=None,
                            help=f"Pin the {dim} degree (default: the planner decides).")(func)
    for option in reversed(TECHNIQUE_PINS):
        flag = option.replace("_", "-")
        func = click.option(f"--{flag}/--no-{flag}", option, default=None,
                            help=f"Use (or, with --no-..., never use) {option} (default: the planner decides).")(func)
    func = click.option("--zero", "zero_stage", type=click.IntRange(1, 3), default=None,
                        help="Pin the ZeRO stage (1, 2 or 3).")(func)
    func = click.option("--checkpointing", type=click.Choice(["none", "selective", "full"]), default=None,
                        help="Pin activation checkpointing.")(func)
    return func


@click.command("train", cls=TrainCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--plan", default=None, metavar="FILE",
              help="Plan file written by `sp-plan plan --out` (fixes model, layout and options).")
@click.option("--seq-len", type=SEQ_LEN, default=2048, show_default=True, help="Tokens per sequence (4096, 8K, ...).")
@click.option("--steps", type=click.IntRange(1, 1 << 30), default=30, show_default=True,
              help="Train until this optimizer step (counting resumed ones).")
@click.option("--micro-batch", type=click.IntRange(1, 1 << 16), default=1, show_default=True)
@click.option("--global-batch", type=click.IntRange(1, 1 << 30), default=None,
              help="Sequences per optimizer step (default: one micro-batch per data-parallel rank).")
@click.option("--lr", type=FiniteFloatRange(0.0, 1e3, min_open=True), default=2e-3, show_default=True)
@click.option("--seed", type=click.IntRange(0, (1 << 63) - 1), default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Compute dtype (default: bf16 on GPUs, fp32 on CPU).")
@click.option("--topology", default=None, metavar="PRESET|FILE",
              help="Topology preset or file for planning (default: probe this machine).")
@click.option("--layers", type=MODEL_SIZE, default=4, show_default=True, help="Model layers (ignored with --plan).")
@click.option("--hidden", type=MODEL_SIZE, default=128, show_default=True, help="Hidden size (ignored with --plan).")
@click.option("--heads", type=MODEL_SIZE, default=4, show_default=True, help="Attention heads (ignored with --plan).")
@click.option("--kv-heads", type=MODEL_SIZE, default=2, show_default=True, help="Key/value heads (ignored with --plan).")
@click.option("--ffn", type=MODEL_SIZE, default=352, show_default=True, help="FFN hidden size (ignored with --plan).")
@click.option("--hf", is_flag=True,
              help="Train a Hugging Face transformers LlamaForCausalLM of the same architecture (random weights, "
                   "no download; needs the [hf] extra) instead of the runtime's own Llama.")
@click.option("--model", "model_config", type=click.Path(path_type=Path), default=None, metavar="CONFIG.JSON",
              help="Train the Hugging Face architecture of this config.json (or its folder), e.g. a DeepSeek (MLA, "
                   "MoE) or Qwen3-MoE one, with random weights (no download; needs the [hf] extra); replaces "
                   "--layers/--hidden/--heads/--kv-heads/--ffn/--hf.")
@click.option("--ep", "ep", type=click.IntRange(1, MAX_DEGREE), default=None,
              help="Pin the expert-parallel degree (MoE models given with --model; Qwen3-MoE and Mixtral; default: 1).")
@click.option("--sp-only/--no-sp-only", default=True, show_default=True,
              help="Split every sequence over all ranks (no data parallelism); --no-sp-only lets the planner "
                   "choose any layout (ignored with --plan).")
@_pin_options
@click.option("--dataset", default=None,
              help="Hugging Face text dataset: a .jsonl/.json/.txt/.parquet/.csv/.arrow file, a directory of them "
                   "or of datasets.save_to_disk, or a hub name (needs --tokenizer). Default: this Python's "
                   "standard library, byte-level.")
@click.option("--tokenizer", default=None, help="Tokenizer directory (save_pretrained) or hub name.")
@click.option("--text-column", default="text", show_default=True)
@click.option("--split", default="train", show_default=True)
@click.option("--positions", type=click.Choice(["continuous", "per-document"]), default="continuous",
              show_default=True,
              help="Packed rows: GPT-style continuous positions (attention across the documents of a row), or "
                   "HF-style positions restarting per document (document-masked attention).")
@click.option("--packing", type=click.Choice(PACKINGS), default=None,
              help="How --dataset documents become rows: stream (concatenate and cut), first_fit "
                   "(whole documents, data order; longer ones split), sorted (first-fit longest first). Rows of "
                   "first_fit/sorted end in padding, which is left out of the loss and the token counts. "
                   "Default: the --plan's packing, else stream.")
@click.option("--sharding", "sharding", type=click.Choice(RUNTIME_SHARDING_CHOICES), default=None,
              help="How a packed row is split over the ring ranks: zigzag over the row, per_document (every "
                   "document in 2 x ring head-tail chunks; needs --positions per-document), or auto (the planner's "
                   "choice at the plan's ring degree, priced on the dataset's lengths; the default).")
@click.option("--data-cache", type=click.Path(path_type=Path), default=None,
              help="Where packed datasets are cached (default: ~/.cache/sp-plan/packed).")
@click.option("--corpus", type=click.Path(path_type=Path), default=None,
              help="Byte-level default: directory of .py files (default: this Python's standard library).")
@click.option("--corpus-bytes", type=click.IntRange(1, 1 << 40), default=DEFAULT_CORPUS_BYTES, show_default=True)
@click.option("--checkpoint-dir", type=click.Path(path_type=Path), default=None,
              help="Save checkpoints here (after the last step, every --save-every steps, and on SIGTERM/SIGINT).")
@click.option("--save-every", type=click.IntRange(0, 1 << 30), default=0, show_default=True,
              help="Checkpoint every N steps (0: only at the end).")
@click.option("--keep-checkpoints", type=click.IntRange(1, 1 << 20), default=2, show_default=True, help="Keep the newest N checkpoints.")
@click.option("--async-save", is_flag=True,
              help="Write periodic checkpoints in the background (training waits only for a copy to host memory; "
                   "costs one host copy of each rank's state).")
@click.option("--resume", is_flag=True,
              help="Continue from the newest checkpoint in --checkpoint-dir that verifies (newer ones that do not "
                   "are skipped, and said); an error (exit 2) if there is none.")
@click.option("--resume-or-start", is_flag=True,
              help="Like --resume, but start a new run when --checkpoint-dir holds no checkpoint at all.")
@click.option("--override-hparams", is_flag=True,
              help="On resume, use this command line's --lr (and schedule) even where it differs from the "
                   "checkpoint's (default: such a difference is an error naming both values).")
@click.option("--tensorboard", type=click.Path(path_type=Path), default=None,
              help="Write TensorBoard scalars to this directory.")
@click.option("--metrics-file", type=click.Path(path_type=Path), default=None,
              help="Append one JSON line per step (rank 0).")
@click.option("--log-every", type=click.IntRange(0, 1 << 30), default=10, show_default=True, help="Print a telemetry line every N steps.")
@click.option("--live-bytes-every", type=click.IntRange(0, 1 << 30), default=0, show_default=True,
              help="CPU: profile live tensor bytes every N steps (slows those steps).")
@click.option("--no-progress", "progress", flag_value=False, default=True, help="No progress bar.")
@click.option("--max-predicted-hours", type=FiniteFloatRange(0.0, 1e7, min_open=True), default=None, metavar="HOURS",
              help="Refuse to start when the plan's predicted step time x --steps exceeds this (default: 1 hour "
                   "on CPU, 7 days on GPUs); --yes starts anyway.")
@click.option("--yes", is_flag=True, help="Start even when the predicted run time exceeds the bound.")
@click.option("--log-level", type=click.Choice(("debug", "info", "warning", "error"), case_sensitive=False),
              default=None, help="Messages shown (as sp-plan --log-level): debug, info (default), warning, error.")
@click.option("--wandb-project", default=None, metavar="NAME",
              help="Also report every step (loss, tokens/s, step time and the plan's prediction, memory) to this "
                   "Weights & Biases project, from rank 0 (WANDB_MODE=offline works; needs the [wandb] extra).")
@click.option("--record-calibration", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE.csv",
              help="At the end, append the run's measured step time, tokens/s per GPU and peak memory (median of the "
                   "steps after the first two), beside the plan's prediction, as a row `sp-plan calibrate FILE.csv` "
                   "fits (rank 0; created when absent).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the run's summary (plan, steps, losses, tokens/s, checkpoint, exit reason) as one JSON "
                   "object on stdout at the end, and nothing else there: the log lines go to stderr.")
@click.option("--nproc-per-node", type=click.IntRange(1, 1024), default=None, metavar="N",
              help="Launch N ranks on this machine (torchrun --standalone, in this process) instead of running "
                   "under torchrun: a SIGTERM or SIGINT then stops every rank after its step, saves a checkpoint "
                   "(with --checkpoint-dir) and exits 143 (130) in one line, without a launcher traceback.")
@click.pass_context
def command(ctx: click.Context, **params: Any) -> None:
    """Train with sp-plan's runtime (under torchrun: one process per GPU), from --plan FILE or planning in
    place. By default a small Llama-style model learns this Python's standard library, byte-level (no
    download); --dataset and --tokenizer train on a Hugging Face text dataset. Checkpoints, resume and
    telemetry: docs/training.md."""
    nproc = params.pop("nproc_per_node")
    level = params.pop("log_level")
    as_json = params.pop("as_json")
    if level is not None:
        from sp_plan.cli.main import set_log_level

        set_log_level(level)
    if as_json:  # stdout carries the summary alone
        from sp_plan.runtime.log import configure_logging

        configure_logging(level, stream=sys.stderr)
    options = options_from_params(ctx, params)
    check_data_sources(options)
    if options.record_calibration is not None:  # torch-free: refused before any rank imports torch
        from sp_plan.runtime.calibration_rows import check_record_path
        from sp_plan.runtime.errors import RuntimeConfigError

        try:
            check_record_path(options.record_calibration)
        except RuntimeConfigError as exc:
            fail_once(SourceError(str(exc)))
    if nproc is not None:
        raise click.exceptions.Exit(launch_ranks(nproc, ctx.meta[ARGV_KEY]))
    from sp_plan.runtime.distributed import finish_worker  # torch: only when the command runs
    from sp_plan.runtime.train_run import run_training

    finish_worker(run_training(options, on_finish=print_summary if as_json else None))


def run_summary(setup: Any, result: Any, code: int) -> dict[str, Any]:
    """What ``--json`` prints: the plan that ran (as a plan file holds it), the steps this run took and their
    losses, throughput (all ranks' tokens per second over the steps after this run's first, as the run's ``done:``
    line counts it), the last checkpoint and why the run ended (``completed``, ``non-finite``, ``SIGTERM``,
    ``SIGINT``) with the exit code."""
    records = result.records
    timed = records[1:] or records  # as the run's "done:" line: the first step includes the warm-up
    timed_tokens, timed_seconds = sum(r.tokens for r in timed), sum(r.seconds for r in timed)
    return {
        "plan": setup.plan.model_dump(mode="json"),
        "layout": setup.layout.describe(),
        "world_size": setup.layout.world,
        "start_step": result.start_step,
        "step": result.step,
        "steps_run": len(records),
        "losses": [r.loss for r in records],
        "skipped_steps": result.skipped_steps,
        "tokens": sum(r.tokens for r in records),
        "seconds": result.seconds,
        "tokens_per_s": timed_tokens / timed_seconds if timed_seconds > 0 else None,
        "tokens_per_s_steps": [timed[0].step, timed[-1].step] if timed else None,
        "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
        "resumed_from": None if result.resumed_from is None else str(result.resumed_from),
        "exit_reason": result.stopped_by or "completed",
        "exit_code": code,
    }


def print_summary(setup: Any, result: Any, code: int) -> None:
    """Rank 0 prints :func:`run_summary` as one JSON line on stdout."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        click.echo(strict_dumps(finite_or_null(run_summary(setup, result, code))))


def options_from_params(ctx: click.Context, params: dict[str, Any]) -> TrainRunOptions:
    """The run's options from the parsed command line; a combination that cannot run is a usage error."""
    params = {k: v for k, v in params.items() if k not in ("nproc_per_node", "log_level", "as_json")}
    pins = {dim: params.pop(dim) for dim in (*degrees.registered(), "ep") if dim in params}
    options = TrainRunOptions(**params, layout_pins={k: v for k, v in pins.items() if v is not None})
    problems = options.conflicts()
    if problems:
        fail_once(click.UsageError("; ".join(problems), ctx))
    if options.wandb_project is not None:
        try:
            import wandb  # noqa: F401  (only when asked for: a second of import)
        except ImportError:
            fail_once(click.UsageError("--wandb-project needs the wandb package: pip install 'sp-plan[wandb]' (or "
                                       "drop --wandb-project)", ctx))
    return options


class SourceError(click.ClickException):
    """A data source (dataset or tokenizer) that cannot be loaded: exit 2, as other project errors."""

    exit_code = 2


def check_data_sources(options: TrainRunOptions) -> None:
    """Refuse, before any rank imports a model or plans, a --dataset path that does not exist or a
    --tokenizer that is neither local, cached nor on the hub. Every rank checks (locally, then at most one
    bounded hub query); local rank 0 says why, once per node."""
    if options.tokenizer is None:
        return
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.text_data import check_dataset_source, tokenizer_source_problem

    try:
        check_dataset_source(options.dataset)
    except RuntimeConfigError as exc:
        fail_once(SourceError(str(exc)))
    problem = tokenizer_source_problem(options.tokenizer)
    if problem:
        fail_once(SourceError(problem))


def parse_options(argv: list[str], prog_name: str = "sp-plan train") -> TrainRunOptions:
    """Parse a ``train`` command line without running it (examples/train_long_context.py uses this): usage
    errors are shown (by the reporting rank) and end in ``SystemExit`` with click's code, as argparse does."""
    try:
        ctx = command.make_context(prog_name, list(argv))
        with ctx:
            return options_from_params(ctx, ctx.params)
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
