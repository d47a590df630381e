"""Long-context training with sequence parallelism, configured by one call to ``sp_plan.runtime.auto_configure``.

By default a small Llama-style model learns the Python standard library's own source code (every
``*.py`` file of this interpreter's stdlib, concatenated, byte-level tokens: no download); with
``--dataset`` and ``--tokenizer`` it trains on a Hugging Face text dataset (local files, a
``save_to_disk`` directory or a hub name) tokenised and packed to the planned sequence length. Each
sequence is split over the ranks by the plan: Ulysses, zigzag Ring or both (USP), FSDP2 over the same
ranks. ``sp_plan.runtime.trainer.Trainer`` runs the loop: checkpoints, resume, telemetry.

CPU (gloo), 4 ranks, a few dozen steps::

    torchrun --nproc-per-node 4 examples/train_long_context.py

Let the planner also consider data parallelism, pin a layout, or run a plan file from the planner::

    torchrun --nproc-per-node 4 examples/train_long_context.py --no-sp-only
    torchrun --nproc-per-node 4 examples/train_long_context.py --ulysses 2 --ring 2 --seq-len 8K
    torchrun --nproc-per-node 4 examples/train_long_context.py --tp 2 --ulysses 2 --tiled-mlp --tiled-loss
    torchrun --nproc-per-node 4 examples/train_long_context.py --hf --tp 2 --ulysses 2   # a transformers Llama
    sp-plan export plan.yaml --to torchrun      # prints: torchrun ... -m sp_plan.cli train --plan plan.yaml

Real data, checkpoints every 50 steps, resume from the newest one that verifies (SIGTERM/Ctrl-C: the step
finishes, a checkpoint is saved, the run exits cleanly), TensorBoard::

    torchrun --nproc-per-node 4 examples/train_long_context.py --dataset corpus.jsonl --tokenizer tok/ \
        --seq-len 8K --steps 200 --checkpoint-dir ckpt --save-every 50 --resume --tensorboard tb

``--resume`` fails (exit 2, one line) when --checkpoint-dir holds no checkpoint that verifies;
``--resume-or-start`` starts a new run when it holds none at all. A run without either refuses a
--checkpoint-dir that already holds checkpoints. On resume, a --lr (or seed) other than the
checkpoint's is an error naming both unless ``--override-hparams`` (then the new lr applies, the
warm-up schedule keeps its step count). ``--resume`` without ``--plan`` and layout pins on the checkpoint's number of ranks reuses the
checkpoint's plan (re-planning on a freshly probed machine could choose another layout); on another
number of ranks the run is re-planned and the checkpoint resharded.

The same script runs on GPUs (NCCL, bf16 by default there). Without ``--plan``, rank 0 plans for the
probed machine (or ``--topology``) and every rank checks it holds the same plan.

This file is a thin wrapper: the options and the run are the installed ``sp-plan train`` command's
(``sp_plan.cli.commands.train`` parses them, ``sp_plan.runtime.train_run`` runs them), so an installed
package runs the same thing without this checkout::

    torchrun --nproc-per-node 4 -m sp_plan.cli train --ulysses 2 --ring 2 --seq-len 8K
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from sp_plan.cli.commands.train import parse_options  # noqa: E402
from sp_plan.cost_models.errors import CostModelError  # noqa: E402
from sp_plan.runtime.train_options import TrainRunOptions  # noqa: E402


def parse_args(argv: list[str] | None = None) -> TrainRunOptions:
    """The run's options from ``argv`` (default: this process's arguments); usage errors exit 2."""
    return parse_options(sys.argv[1:] if argv is None else argv, prog_name=Path(__file__).name)


def main(argv: list[str] | None = None) -> int:
    """Train; the exit code (3 when the loss diverged). Errors of the plan, data or runtime are raised."""
    from sp_plan.runtime.train_run import run_training

    return run_training(parse_args(argv))


if __name__ == "__main__":
    try:
        code = main()
    except CostModelError as exc:  # one line, like the CLI (plan, planner and runtime errors)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from sp_plan.runtime.distributed import finish_worker

    finish_worker(code)
