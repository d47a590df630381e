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
    sp-plan export --plan plan.yaml --to torchrun      # prints: torchrun ... train_long_context.py --plan plan.yaml

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
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sp_plan.cost_models.errors import CostModelError  # noqa: E402
from sp_plan.cost_models.model_spec import ModelSpec  # noqa: E402
from sp_plan.cost_models.units import parse_seq_len  # noqa: E402
from sp_plan.runtime.auto import auto_configure  # noqa: E402
from sp_plan.runtime.data import TokenWindows  # noqa: E402
from sp_plan.runtime.errors import RuntimeConfigError  # noqa: E402
from sp_plan.runtime.models import LlamaModel  # noqa: E402
from sp_plan.runtime.text_data import GlobalBatches  # noqa: E402
from sp_plan.runtime.trainer import Trainer  # noqa: E402

#: Byte-level tokenizer: 256 byte values plus these special tokens.
PAD, BOS, EOS = 256, 257, 258
VOCAB = 259
#: Corpus size cap: plenty for a few dozen steps, and quick to read on every rank.
DEFAULT_CORPUS_BYTES = 8 << 20
WARMUP_STEPS = 5


#: Layout degrees and memory techniques the command line can pin.
LAYOUT_PINS = ("ulysses", "ring", "tp", "dp_shard", "dp_replicate")
TECHNIQUE_PINS = ("tiled_mlp", "tiled_loss", "offload_checkpoints", "offload_optimizer", "offload_params")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", help="plan file written by `sp-plan plan --out` (fixes model, layout and options)")
    p.add_argument("--seq-len", type=parse_seq_len, default=2048, help="tokens per sequence (4096, 8K, ...)")
    p.add_argument("--steps", type=int, default=30, help="train until this optimizer step (counting resumed ones)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: one micro-batch per data-parallel rank)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="compute dtype (default: bf16 on GPUs, fp32 on CPU)")
    p.add_argument("--topology", default=None,
                   help="topology preset or file for planning (default: probe this machine)")
    model = p.add_argument_group("model (ignored with --plan)")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--hidden", type=int, default=128)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--ffn", type=int, default=352)
    p.add_argument("--hf", action="store_true",
                   help="train a Hugging Face transformers LlamaForCausalLM of the same architecture (random "
                        "weights, no download; needs the [hf] extra) instead of the runtime's own Llama")
    pins = p.add_argument_group("layout and options the planner must use (ignored with --plan)")
    pins.add_argument("--sp-only", action=argparse.BooleanOptionalAction, default=True,
                      help="split every sequence over all ranks (no data parallelism); --no-sp-only lets the "
                           "planner choose any layout")
    for dim in LAYOUT_PINS:
        pins.add_argument(f"--{dim.replace('_', '-')}", dest=dim, type=int, default=None)
    pins.add_argument("--checkpointing", choices=["none", "selective", "full"], default=None)
    pins.add_argument("--zero", dest="zero_stage", type=int, choices=[1, 2, 3], default=None)
    for option in TECHNIQUE_PINS:
        pins.add_argument(f"--{option.replace('_', '-')}", dest=option, action=argparse.BooleanOptionalAction,
                          default=None, help=f"use (or, with --no-..., never use) {option} (default: the planner "
                                             "decides)")
    data = p.add_argument_group("data (default: this Python's standard library, byte-level)")
    data.add_argument("--dataset", default=None,
                      help="Hugging Face text dataset: a .jsonl/.json/.txt/.parquet/.csv/.arrow file, a directory of "
                           "them or of datasets.save_to_disk, or a hub name (needs --tokenizer)")
    data.add_argument("--tokenizer", default=None, help="tokenizer directory (save_pretrained) or hub name")
    data.add_argument("--text-column", default="text")
    data.add_argument("--split", default="train")
    data.add_argument("--positions", choices=["continuous", "per-document"], default="continuous",
                      help="packed rows: GPT-style continuous positions (attention across the documents of a "
                           "row), or HF-style positions restarting per document (document-masked attention)")
    data.add_argument("--data-cache", type=Path, default=None,
                      help="where packed datasets are cached (default: ~/.cache/sp-plan/packed)")
    data.add_argument("--corpus", type=Path, default=None,
                      help="byte-level default: directory of .py files (default: this Python's standard library)")
    data.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    run = p.add_argument_group("checkpoints and telemetry")
    run.add_argument("--checkpoint-dir", type=Path, default=None,
                     help="save checkpoints here (after the last step, every --save-every steps, and on SIGTERM/"
                          "SIGINT)")
    run.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    run.add_argument("--keep-checkpoints", type=int, default=2, help="keep the newest N checkpoints")
    run.add_argument("--async-save", action="store_true",
                     help="write periodic checkpoints in the background (training waits only for a copy to host "
                          "memory; costs one host copy of each rank's state)")
    resume = run.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir that verifies (newer ones that "
                             "do not are skipped, and said); an error (exit 2) if there is none")
    resume.add_argument("--resume-or-start", action="store_true",
                        help="like --resume, but start a new run when --checkpoint-dir holds no checkpoint at all")
    run.add_argument("--override-hparams", action="store_true",
                     help="on resume, use this command line's --lr (and schedule) even where it differs from the "
                          "checkpoint's (default: such a difference is an error naming both values)")
    run.add_argument("--tensorboard", type=Path, default=None, help="write TensorBoard scalars to this directory")
    run.add_argument("--metrics-file", type=Path, default=None, help="append one JSON line per step (rank 0)")
    run.add_argument("--log-every", type=int, default=10, help="print a telemetry line every N steps")
    run.add_argument("--live-bytes-every", type=int, default=0,
                     help="CPU: profile live tensor bytes every N steps (slows those steps)")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = p.parse_args(argv)
    if (args.dataset is None) != (args.tokenizer is None):
        p.error("--dataset and --tokenizer go together (the default corpus is byte-level)")
    if args.async_save and args.checkpoint_dir is None:
        p.error("--async-save needs --checkpoint-dir")
    if (args.resume or args.resume_or_start) and args.checkpoint_dir is None:
        p.error("--resume and --resume-or-start need --checkpoint-dir")
    if args.save_every and args.checkpoint_dir is None:
        p.error("--save-every needs --checkpoint-dir")
    return args


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


def tokenizer_vocabulary(args: argparse.Namespace) -> tuple[int, int]:
    """(vocabulary size, padding id) of the run's tokenizer: the byte-level one, or --tokenizer's."""
    if args.tokenizer is None:
        return VOCAB, PAD
    from sp_plan.runtime.text_data import check_dataset_source, load_tokenizer

    check_dataset_source(args.dataset)  # fail before the slow parts
    tokenizer = load_tokenizer(args.tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return len(tokenizer), pad


def build_model(args: argparse.Namespace, plan, vocab: int) -> torch.nn.Module:
    if plan is not None:
        spec = plan.model
    else:
        prefix = "byte-llama" if args.tokenizer is None else "llama"
        spec = ModelSpec(name=f"{prefix}-{args.layers}x{args.hidden}", num_layers=args.layers,
                         hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         head_dim=args.hidden // args.heads, ffn_hidden_size=args.ffn, vocab_size=vocab)
    if spec.vocab_size < vocab:
        raise RuntimeConfigError(f"the plan's model has a vocabulary of {spec.vocab_size}; the tokenizer needs {vocab}")
    torch.manual_seed(args.seed)
    if args.hf:
        return build_hf_model(spec, args.seq_len)
    model = LlamaModel(spec)
    model.init_weights(generator=torch.Generator().manual_seed(args.seed))
    return model


def build_hf_model(spec: ModelSpec, seq_len: int) -> torch.nn.Module:
    """A transformers causal LM with ``spec``'s architecture and random weights (seeded above)."""
    try:
        from sp_plan.runtime.hf import hf_model_from_spec

        return hf_model_from_spec(spec, seq_len)
    except ImportError as exc:
        raise RuntimeConfigError("--hf needs transformers: pip install 'sp-plan[hf]'") from exc


def pins_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, k) is not None for k in (*LAYOUT_PINS, "checkpointing", "zero_stage", *TECHNIQUE_PINS))


def checkpoint_plan(args: argparse.Namespace):
    """The plan of the checkpoint ``--resume`` will load, when this launch may reuse it: no --plan, no
    pins, the same number of ranks. Re-planning could pick another layout on a noisy probe."""
    if not (args.resume or args.resume_or_start) or args.plan or pins_given(args):
        return None
    from sp_plan.planner.plan import plan_from_dict
    from sp_plan.runtime.checkpoint import list_checkpoints, read_verified_state

    # The newest checkpoint whose bookkeeping matches its manifest (the Trainer then verifies every file of
    # the one it resumes from, and may fall back further: the same run's plan).
    for _, path in reversed(list_checkpoints(args.checkpoint_dir)):
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


def make_data(args: argparse.Namespace, setup) -> tuple[GlobalBatches, str]:
    """This rank's resumable batch stream and a line describing the data."""
    train = setup.train
    if args.dataset is None:
        tokens = read_corpus(args.corpus, args.corpus_bytes)
        dataset = TokenWindows(tokens, train.seq_len)
        what = (f"{tokens.numel():,} byte tokens of Python stdlib source, {len(dataset)} sequences of "
                f"{train.seq_len:,}")
    else:
        from sp_plan.runtime.text_data import PackedTextDataset, check_vocabulary

        log = print if dist.get_rank() == 0 else None
        dataset = PackedTextDataset.build(args.dataset, args.tokenizer, train.seq_len, text_column=args.text_column,
                                          split=args.split, positions=args.positions.replace("-", "_"),
                                          cache_dir=args.data_cache, log=log)
        check_vocabulary(dataset, setup.plan.model.vocab_size)
        if dataset.positions == "per_document":  # refused up front if the runtime cannot train such rows
            try:
                setup.sharder.prepare({k: v.unsqueeze(0) for k, v in dataset[0].items()})
            except RuntimeConfigError as exc:
                raise RuntimeConfigError(f"{exc} (this example: --positions continuous)") from None
        what = dataset.describe()
    data = GlobalBatches.for_setup(setup, dataset, seed=args.seed)
    if data.sequences_per_step > len(dataset):
        raise RuntimeConfigError(
            f"the data gives {len(dataset)} sequences, fewer than one step of {data.sequences_per_step}: use a shorter "
            "--seq-len or more data"
        )
    line = (f"data: {what}; {setup.dp_size} data-parallel group(s); {train.grad_accum} micro-batch(es) of "
            f"{train.micro_batch} per step")
    return data, line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab, pad = tokenizer_vocabulary(args)
    plan = None
    if args.plan:
        from sp_plan.planner.plan import load_plan

        plan = load_plan(args.plan)
    reused = checkpoint_plan(args) if plan is None else None
    model = build_model(args, plan or reused, vocab)
    if plan is not None or reused is not None:
        setup = auto_configure(model, plan=plan or reused, pad_token_id=pad)
    else:
        pins = {k: getattr(args, k) for k in LAYOUT_PINS if getattr(args, k)}
        if args.sp_only:
            for dim in ("dp_shard", "dp_replicate", "tp"):
                pins.setdefault(dim, 1)
        options = {k: getattr(args, k) for k in ("checkpointing", "zero_stage", *TECHNIQUE_PINS)
                   if getattr(args, k) is not None}
        setup = auto_configure(model, seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=args.dtype,
                               global_batch=args.global_batch, topology=args.topology, fixed_layout=pins,
                               fixed_options=options, pad_token_id=pad)
    rank0 = dist.get_rank() == 0
    if rank0:
        print("\n".join(setup.describe()))
        if reused is not None:
            print("  (the plan of the checkpoint being resumed)")
    data, data_line = make_data(args, setup)
    if rank0:
        print(data_line, flush=True)
    optimizer = setup.make_optimizer(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    trainer = Trainer(setup, optimizer, data, max_steps=args.steps, scheduler=schedule, max_grad_norm=1.0,
                      checkpoint_dir=args.checkpoint_dir, save_every=args.save_every,
                      keep_checkpoints=args.keep_checkpoints,
                      resume="auto" if args.resume_or_start else args.resume, override_hparams=args.override_hparams,
                      run_config={"warmup_steps": WARMUP_STEPS, "seed": args.seed}, log_every=args.log_every,
                      tensorboard_dir=args.tensorboard, metrics_file=args.metrics_file, progress=args.progress,
                      live_bytes_every=args.live_bytes_every, async_save=args.async_save)
    result = trainer.fit()
    return 3 if result.stopped_by == "non-finite" else 0  # diverged: the job must not look successful


if __name__ == "__main__":
    try:
        code = main()
    except CostModelError as exc:  # one line, like the CLI (plan, planner and runtime errors)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from sp_plan.runtime.auto import finish_worker

    finish_worker(code)
