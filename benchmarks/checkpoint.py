"""How long training stops for a checkpoint: synchronous saves vs background saves (``async_save``), on CPU.

Two gloo ranks train the same Llama (dp_shard 2, ZeRO-3, AdamW: each rank saves its half of the fp32
weights and both Adam moments) for ``--steps`` steps, saving every ``--save-every``, once with
``Trainer(async_save=False)`` and once with ``async_save=True``, in the same run. Per save it times the
call the training loop blocks on (``Trainer.save``: the whole write when synchronous; the bookkeeping
and the copy to host buffers when in the background), and the whole ``fit`` including the wait for the
last save. Ratios are background / synchronous (lower is better).

On CPU ranks the background writer shares the cores with training, so the wall-time gain understates
what a GPU run sees, where training runs on the GPU while the thread writes from host memory.

    python benchmarks/checkpoint.py                 # the table (about a minute on 2 cores)
    python benchmarks/checkpoint.py --hidden 768    # a larger state per rank
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed import run_ranks  # noqa: E402

SEQ = 256
VOCAB = 8192


def _rank(rank: int, world: int, directory: str, hidden: int, layers: int, steps: int, save_every: int,
          asynchronous: bool) -> dict:
    import torch

    from sp_plan.cost_models import ModelSpec
    from sp_plan.runtime.auto import auto_configure
    from sp_plan.runtime.data import TokenWindows
    from sp_plan.runtime.models import LlamaModel
    from sp_plan.runtime.text_data import GlobalBatches
    from sp_plan.runtime.trainer import Trainer

    spec = ModelSpec(name="bench-ckpt", num_layers=layers, hidden_size=hidden, num_heads=hidden // 64,
                     num_kv_heads=hidden // 64, head_dim=64, ffn_hidden_size=3 * hidden, vocab_size=VOCAB)
    model = LlamaModel(spec)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    setup = auto_configure(model, seq_len=SEQ, global_batch=2, dtype="fp32", topology="dgx-h100",
                           fixed_layout={"dp_shard": 2}, fixed_options={"zero_stage": 3})
    optimizer = setup.make_optimizer(lr=1e-3)
    stream = torch.arange(64 * SEQ) % VOCAB
    data = GlobalBatches.for_setup(setup, TokenWindows(stream, SEQ), seed=0)
    trainer = Trainer(setup, optimizer, data, max_steps=steps, checkpoint_dir=directory, save_every=save_every,
                      keep_checkpoints=1, async_save=asynchronous, progress=False, log_every=0,
                      print_fn=lambda _: None, handle_signals=False)
    blocked: list[float] = []
    save = trainer.save

    def timed_save():
        started = time.perf_counter()
        path = save()
        blocked.append(time.perf_counter() - started)
        return path

    trainer.save = timed_save
    started = time.perf_counter()
    fit = trainer.fit()
    wall = time.perf_counter() - started
    state_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(setup.model, optimizer))
    return {"blocked": blocked, "wall": wall, "step_s": [r.seconds for r in fit.records], "bytes": state_bytes}


def _local_tensors(model, optimizer):
    for p in model.parameters():
        yield p.to_local() if hasattr(p, "to_local") else p
    for state in optimizer.state.values():
        for value in state.values():
            yield value.to_local() if hasattr(value, "to_local") else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for mode, asynchronous in (("synchronous", False), ("background", True)):
        with tempfile.TemporaryDirectory() as tmp:
            per_rank = run_ranks(2, _rank, tmp, args.hidden, args.layers, args.steps, args.save_every, asynchronous,
                                 timeout=600)
        blocked = [max(r["blocked"][i] for r in per_rank) for i in range(len(per_rank[0]["blocked"]))]
        steps = [s for r in per_rank for s in r["step_s"]]
        rows[mode] = {"saves": len(blocked), "blocked_median": statistics.median(blocked),
                      "blocked_total": sum(blocked), "wall": max(r["wall"] for r in per_rank),
                      "step_median": statistics.median(steps), "bytes": per_rank[0]["bytes"]}
    print(f"2 gloo ranks, dp_shard 2 ZeRO-3 AdamW, {rows['synchronous']['bytes'] / 1e6:.0f} MB of model and "
          f"optimizer state per rank; {args.steps} steps, a save every {args.save_every}\n")
    print(f"{'mode':<12} {'saves':>5} {'blocked/save s':>15} {'blocked total s':>16} {'step s (median)':>16} "
          f"{'fit wall s':>11}")
    for mode, r in rows.items():
        print(f"{mode:<12} {r['saves']:>5} {r['blocked_median']:>15.3f} {r['blocked_total']:>16.3f} "
              f"{r['step_median']:>16.3f} {r['wall']:>11.2f}")
    sync, bg = rows["synchronous"], rows["background"]
    print(f"\nbackground / synchronous: blocked per save {bg['blocked_median'] / sync['blocked_median']:.2f}x, "
          f"fit wall {bg['wall'] / sync['wall']:.2f}x (the last save's wait included)")


if __name__ == "__main__":
    main()
