"""Sequence-parallel attention with the runtime's context API, checked against single-device attention.

    torchrun --nproc-per-node 4 examples/sp_attention.py                 # ring 2 x ulysses 2 (USP)
    torchrun --nproc-per-node 4 examples/sp_attention.py --ring 4         # zigzag ring only
    torchrun --nproc-per-node 4 examples/sp_attention.py --plan plan.yaml # degrees from a plan file

Every rank builds the same full-sequence q, k, v (so the check can recompute the answer on one
device), keeps only its shard, applies RoPE with its *global* positions, runs exact distributed
attention forward and backward, and compares the gathered output and gradients with single-device
attention on the whole sequence. Then the same for packed rows (``--documents``, default 4 per row):
positions restart at 0 per document and ``cu_seqlens`` (the document boundaries over the whole batch,
the same on every rank) makes every token attend only within its document. Runs on CPU (gloo) or one
GPU per rank (NCCL).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch
import torch.distributed as dist

from sp_plan.cost_models.layout import Layout
from sp_plan.runtime.attention import local_attention
from sp_plan.runtime.context import SequenceParallel
from sp_plan.runtime.mesh import build_mesh, load_layout

#: fp32 results must agree with single-device attention to this max-norm relative error.
TOLERANCE = 1e-5
ROPE_BASE = 10_000.0


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim) at the given global positions."""
    half = x.shape[-1] // 2
    freqs = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]  # (seq, half)
    cos, sin = angles.cos().to(x.dtype)[None, :, None, :], angles.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def packed_documents(seq: int, batch: int, documents: int, gen: torch.Generator):
    """Document boundaries (the same in every row, for the example's 1-D RoPE positions): per-document
    positions (seq,) and ``cu_seqlens`` over the flattened (batch x seq)."""
    cuts = sorted(torch.randperm(seq - 1, generator=gen)[: documents - 1].add(1).tolist())
    bounds = [0, *cuts, seq]
    positions = torch.cat([torch.arange(hi - lo) for lo, hi in zip(bounds, bounds[1:])])
    cu = torch.tensor(sorted({b * seq + p for b in range(batch) for p in bounds}), dtype=torch.int32)
    return positions, cu


def check(sp, q, k, v, dout, positions, cu_seqlens=None) -> dict[str, float]:
    """Distributed attention on this rank's shards vs single-device attention on the whole sequence."""
    q_local, k_local, v_local = (sp.shard(x, dim=1).clone().requires_grad_() for x in (q, k, v))
    local_positions = sp.shard(positions, dim=0)  # global positions (per document when packed)
    out_local = sp.attention(rope(q_local, local_positions), rope(k_local, local_positions), v_local, causal=True,
                             cu_seqlens=cu_seqlens)
    out_local.backward(sp.shard(dout, dim=1))

    q_full, k_full, v_full = (x.clone().requires_grad_() for x in (q, k, v))
    out_full = local_attention(rope(q_full, positions), rope(k_full, positions), v_full, causal=True,
                               cu_seqlens=cu_seqlens)
    out_full.backward(dout)
    return {
        "out": rel_err(sp.gather(out_local.detach(), dim=1), out_full.detach()),
        "dq": rel_err(sp.gather(q_local.grad, dim=1), q_full.grad),
        "dk": rel_err(sp.gather(k_local.grad, dim=1), k_full.grad),
        "dv": rel_err(sp.gather(v_local.grad, dim=1), v_full.grad),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="plan file (YAML/JSON with a 'layout:' mapping); overrides --ring/--ulysses")
    parser.add_argument("--ring", type=int, default=None, help="ring degree (default: 2 when the world allows)")
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: the rest of the world)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--documents", type=int, default=4, help="documents per packed row in the second check")
    args = parser.parse_args()

    if args.plan:
        layout = load_layout(args.plan)
    else:
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        ring = args.ring if args.ring is not None else (2 if world % 2 == 0 and world > 2 else 1)
        ulysses = args.ulysses if args.ulysses is not None else world // ring
        layout = Layout.for_world(world, ring=ring, ulysses=ulysses)
    mesh = build_mesh(layout)
    sp = SequenceParallel.from_mesh(mesh)
    device = mesh.device

    # The same full problem on every rank (fixed seed), so each rank can check the answer by itself.
    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, kv_heads, head_dim = 2, args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(batch, seq, heads, head_dim, generator=gen).to(device)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device)
    dout = torch.randn(batch, seq, heads, head_dim, generator=gen).to(device)

    # --- what a training step does: shard the sequence, use global positions, attend -----------
    positions = torch.arange(seq, device=device)
    packed_positions, cu_seqlens = packed_documents(seq, batch, max(args.documents, 1), gen)
    runs = {"dense": check(sp, q, k, v, dout, positions),
            f"packed ({args.documents} documents per row)": check(sp, q, k, v, dout, packed_positions.to(device),
                                                                  cu_seqlens)}
    ok = True
    if dist.get_rank() == 0:
        mine = sp.positions(seq)
        print(f"layout {layout.describe()}: {sp}")
        print(f"q {tuple(q.shape)} -> local q {tuple(sp.shard(q, dim=1).shape)}; rank 0 holds positions "
              f"{mine[:4].tolist()}...{mine[-4:].tolist()}; packed: cu_seqlens {cu_seqlens.tolist()}")
    for name, errors in runs.items():
        worst = torch.tensor(max(errors.values()), dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        ok &= worst.item() <= TOLERANCE
        if dist.get_rank() == 0:
            print(f"{name}: max relative error vs single-device attention: "
                  + ", ".join(f"{n} {err:.1e}" for n, err in errors.items())
                  + f" (all ranks: {worst.item():.1e}) -> {'OK' if worst.item() <= TOLERANCE else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    from sp_plan.runtime.auto import finish_worker

    finish_worker(main())  # barrier, destroy the groups, and leave without the interpreter's teardown
