"""torch.compile of a model that uses the sequence-parallel attention (2 gloo ranks).

A small attention block (Q/K/V projections, SP attention, output projection) is compiled with
``fullgraph=True`` (no graph break allowed) and compared with the same block run eagerly: outputs and
every parameter and input gradient, for Ulysses, zigzag Ring, and Ring with packed documents
(``cu_seqlens``) under ``backend="aot_eager"``, plus one ``inductor`` case (Ring). Before the ops were
made compile-compatible this failed with "process group '0' was not registered" (the backward was
traced with fake tensors through the real ring pass) and with fake/real LSE stride mismatches.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

pytestmark = pytest.mark.multiproc

#: (path, backend, packed documents)
CASES = [("ulysses", "aot_eager", False), ("ring", "aot_eager", False), ("ring", "aot_eager", True),
         ("ring", "inductor", False)]


class _Block(torch.nn.Module):
    def __init__(self, sp, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.sp, self.heads, self.kv_heads, self.head_dim = sp, heads, kv_heads, hidden // heads
        self.q = torch.nn.Linear(hidden, heads * self.head_dim)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(heads * self.head_dim, hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        out = self.sp.attention(q, k, v, causal=True, cu_seqlens=cu_seqlens)
        return torch.nn.functional.gelu(self.o(out.reshape(b, s, -1))) + x


def _rank(rank: int, world: int) -> dict:
    from tests.attention_checks import sp_context

    results = {}
    for path, backend, packed in CASES:
        sp = sp_context(world, ring=world if path == "ring" else 1, ulysses=world if path == "ulysses" else 1)
        torch.manual_seed(0)
        block = _Block(sp)
        x_full = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
        cu = torch.tensor([0, 5, 16, 23, 32], dtype=torch.int32) if packed else None  # docs straddle ranks
        x = sp.shard(x_full, dim=1).clone()
        grads = []
        outs = []
        for fn in (block, torch.compile(block, backend=backend, fullgraph=True)):
            block.zero_grad()
            leaf = x.clone().requires_grad_()
            out = fn(leaf, cu)
            out.square().sum().backward()
            outs.append(out.detach())
            grads.append([leaf.grad] + [p.grad.clone() for p in block.parameters()])
        eager, compiled = grads
        results[(path, backend, packed)] = {
            "out": (outs[0] - outs[1]).abs().max().item() / outs[0].abs().max().item(),
            "grads": max(((e - c).abs().max() / e.abs().max()).item() for e, c in zip(eager, compiled)),
        }
    return results


def test_compiled_block_matches_eager_for_ulysses_ring_and_packed_documents():
    for r in run_ranks(2, _rank, timeout=240):
        for case, errors in r.items():
            assert errors["out"] < 1e-6 and errors["grads"] < 1e-5, (case, errors)
