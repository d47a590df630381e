"""Long-context training with sequence parallelism, configured by one call to ``runtime.auto_configure``.

A small Llama-style model learns the Python standard library's own source code (every ``*.py`` file
of this interpreter's stdlib, concatenated, byte-level tokens), with each sequence split over the
ranks by the plan: Ulysses, zigzag Ring or both (USP), FSDP2 over the same ranks.

CPU (gloo), 4 ranks, a few dozen steps::

    torchrun --nproc-per-node 4 examples/train_long_context.py

Let the planner also consider data parallelism, pin a layout, or run a plan file from the planner::

    torchrun --nproc-per-node 4 examples/train_long_context.py --no-sp-only
    torchrun --nproc-per-node 4 examples/train_long_context.py --ulysses 2 --ring 2 --seq-len 8K
    torchrun --nproc-per-node 4 examples/train_long_context.py --tp 2 --ulysses 2 --tiled-mlp --tiled-loss
    torchrun --nproc-per-node 4 examples/train_long_context.py --hf --tp 2 --ulysses 2   # a transformers Llama
    sp-plan export --plan plan.yaml --to torchrun      # prints: torchrun ... train_long_context.py --plan plan.yaml

The same script runs on GPUs (NCCL, bf16 by default there). Without ``--plan``, rank 0 plans for the
probed machine (or ``--topology``) and every rank checks it holds the same plan.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cost_models.errors import CostModelError  # noqa: E402
from cost_models.model_spec import ModelSpec  # noqa: E402
from cost_models.units import parse_seq_len  # noqa: E402
from runtime.auto import auto_configure  # noqa: E402
from runtime.data import TokenWindows  # noqa: E402
from runtime.errors import RuntimeConfigError  # noqa: E402
from runtime.models import LlamaModel  # noqa: E402
from runtime.step import train_step  # noqa: E402

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
    p.add_argument("--steps", type=int, default=30)
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
        pins.add_argument(f"--{option.replace('_', '-')}", dest=option, action="store_true", default=None,
                          help=f"use {option} (default: the planner decides)")
    p.add_argument("--corpus", type=Path, default=None,
                   help="directory of .py files (default: this Python's standard library)")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    return p.parse_args(argv)


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


def build_model(args: argparse.Namespace, plan) -> torch.nn.Module:
    if plan is not None:
        spec = plan.model
    else:
        spec = ModelSpec(name=f"byte-llama-{args.layers}x{args.hidden}", num_layers=args.layers,
                         hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         head_dim=args.hidden // args.heads, ffn_hidden_size=args.ffn, vocab_size=VOCAB)
    if spec.vocab_size < VOCAB:
        raise RuntimeConfigError(f"the plan's model has a vocabulary of {spec.vocab_size}; this example needs {VOCAB}")
    torch.manual_seed(args.seed)
    if args.hf:
        return build_hf_model(spec, args.seq_len)
    model = LlamaModel(spec)
    model.init_weights(generator=torch.Generator().manual_seed(args.seed))
    return model


def build_hf_model(spec: ModelSpec, seq_len: int) -> torch.nn.Module:
    """A transformers causal LM with ``spec``'s architecture and random weights (seeded above)."""
    try:
        from runtime.hf import hf_model_from_spec

        return hf_model_from_spec(spec, seq_len)
    except ImportError as exc:
        raise RuntimeConfigError("--hf needs transformers: pip install 'sp-plan[hf]'") from exc


class Progress:
    """tqdm when installed, else a plain line every few steps (rank 0 only)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total, self.count = enabled, total, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, loss: float, tokens_per_s: float) -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            self.bar.update(1)
        elif self.count == 1 or self.count % 5 == 0 or self.count == self.total:
            print(f"step {self.count}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = None
    if args.plan:
        from planner.plan import load_plan

        plan = load_plan(args.plan)
    model = build_model(args, plan)
    if plan is not None:
        setup = auto_configure(model, plan=plan, pad_token_id=PAD)
    else:
        pins = {k: getattr(args, k) for k in LAYOUT_PINS if getattr(args, k)}
        if args.sp_only:
            for dim in ("dp_shard", "dp_replicate", "tp"):
                pins.setdefault(dim, 1)
        options = {k: getattr(args, k) for k in ("checkpointing", "zero_stage", *TECHNIQUE_PINS)
                   if getattr(args, k) is not None}
        setup = auto_configure(model, seq_len=args.seq_len, micro_batch=args.micro_batch, dtype=args.dtype,
                               global_batch=args.global_batch, topology=args.topology, fixed_layout=pins,
                               fixed_options=options, pad_token_id=PAD)
    rank0 = dist.get_rank() == 0
    train = setup.train
    tokens = read_corpus(args.corpus, args.corpus_bytes)
    dataset = TokenWindows(tokens, train.seq_len)
    sampler = setup.sampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=train.micro_batch, sampler=sampler, drop_last=True)
    per_epoch = len(loader) // train.grad_accum
    if per_epoch == 0:
        raise RuntimeConfigError(
            f"the corpus gives {len(loader)} micro-batches per data-parallel rank, fewer than one step of "
            f"{train.grad_accum}: use a shorter --seq-len or a larger --corpus-bytes"
        )
    if rank0:
        print("\n".join(setup.describe()))
        print(f"data: {tokens.numel():,} byte tokens of Python stdlib source, {len(dataset)} sequences of "
              f"{train.seq_len:,}; {setup.dp_size} data-parallel group(s); {train.grad_accum} micro-batch(es) "
              f"of {train.micro_batch} per step", flush=True)
    optimizer = setup.make_optimizer(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    progress = Progress(args.steps, rank0)
    step, epoch, first_loss, loss = 0, 0, math.nan, math.nan
    measured_tokens, measured_seconds = 0, 0.0
    started = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(per_epoch):
            micro = [next(batches) for _ in range(train.grad_accum)]
            result = train_step(setup, micro, optimizer, max_grad_norm=1.0)
            schedule.step()
            step += 1
            loss = result.loss
            first_loss = loss if step == 1 else first_loss
            if step > 1:  # the first step includes one-time warm-up work
                measured_tokens += result.tokens
                measured_seconds += result.seconds
            progress.update(loss, result.tokens / result.seconds)
            if step >= args.steps:
                break
        epoch += 1
    progress.close()
    if rank0:
        rate = measured_tokens / measured_seconds if measured_seconds else float("nan")
        print(f"done: {step} steps in {time.perf_counter() - started:.1f} s; loss {first_loss:.3f} -> {loss:.3f}; "
              f"{rate:,.0f} tokens/s (steps 2..{step}, all ranks)")
    dist.barrier()  # gloo tears down badly if a rank leaves while others still talk
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CostModelError as exc:  # one line, like the CLI (plan, planner and runtime errors)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
