"""A symbolic tensor graph: the ops of one transformer block (or of the output layer) with byte sizes.

The memory model does not add up hand-written per-tensor formulas. It describes what the runtime
executes, op by op, as data: which tensors each op creates (bytes per GPU and a category), which it
saves for backward, which transient workspace it needs in forward and in backward. The liveness
simulation (:mod:`.liveness`) then derives, from that one description, the bytes saved for backward
under every checkpointing mode, the transient peak inside a block's forward, its recompute and its
backward (gradient buffers included), so all of them stay consistent with each other and with the
runtime whose ops they mirror.

Categories map to the reported memory components: ``activation`` -> activations, ``logits`` ->
logits, ``comm`` -> buffers (all-to-all and ring staging), ``kv_cache`` -> kv_cache (prefill's cache is
preallocated; the graph only marks the zero-byte writes into it), ``grads`` -> buffers (parameter
gradients a stack accumulates inside an op before handing them to ZeRO's reduction, e.g. DeepSpeed's
TiledMLP across its tiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

KINDS: tuple[str, ...] = ("activation", "logits", "comm", "kv_cache", "grads")

#: Op tags. ``attention``: outputs kept by selective checkpointing ('attention_outputs' policy).
#: ``core_attention``: recomputed by Megatron-style selective recompute ('attention_core_recompute').
ATTENTION = "attention"
CORE_ATTENTION = "core_attention"
#: ``matmul``: a linear layer's GEMM (aten.mm); ``sdpa``: the fused attention kernel (flash/ring). Used by
#: torchtitan-style per-op selective checkpointing ('op_sac').
MATMUL = "matmul"
SDPA = "sdpa"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor one GPU holds: its bytes, category, and whether a gradient flows back into it."""

    name: str
    nbytes: int
    kind: str = "activation"
    requires_grad: bool = True


@dataclass(frozen=True)
class Workspace:
    """Transient bytes an op holds only while it runs (e.g. a packed all-to-all send buffer)."""

    nbytes: int
    kind: str = "activation"


@dataclass(frozen=True)
class Op:
    """One step of the computation.

    ``saves`` names the tensors autograd keeps for this op's backward (inputs or outputs);
    ``holds`` names tensors the mirrored Python code still references while this op runs (a module's
    input stays alive until the module returns), which extends their forward lifetime but not autograd's;
    ``grad_passthrough`` marks ops whose backward hands the output gradient to the inputs unchanged
    (residual add), so no new gradient buffer is allocated for them.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorSpec, ...]
    saves: tuple[str, ...] = ()
    fwd_workspace: tuple[Workspace, ...] = ()
    bwd_workspace: tuple[Workspace, ...] = ()
    tags: frozenset[str] = frozenset()
    grad_passthrough: bool = False
    holds: tuple[str, ...] = ()
    grad_from_saved: str | None = None
    """A saved tensor whose memory becomes the input gradient in backward (a kernel that computed the
    gradient in forward and hands its buffer over, e.g. Liger's fused linear cross-entropy)."""


@dataclass(frozen=True)
class Graph:
    """Ops in forward order. ``outputs`` are handed to the next graph (the next block's input);
    ``retained`` stay allocated after the graph for the rest of the step (the logits a caller holds)."""

    inputs: tuple[TensorSpec, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    retained: tuple[str, ...] = ()
    tensors: dict[str, TensorSpec] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        table = {t.name: t for t in self.inputs}
        for op in self.ops:
            for name in op.inputs + op.saves + op.holds:
                if name not in table and name not in {o.name for o in op.outputs}:
                    raise ValueError(f"op {op.name} uses {name!r} before it exists")
            for out in op.outputs:
                if out.name in table:
                    raise ValueError(f"tensor {out.name!r} is produced twice")
                table[out.name] = out
        self.tensors.update(table)

    # Derived tables the liveness simulation reads on every run; cached on the (immutable) graph,
    # which is itself shared by the simulations of all checkpointing modes.
    def saved_by_autograd(self) -> frozenset[str]:
        """Tensors kept for backward when nothing is checkpointed."""
        return self._saved_by_autograd

    @cached_property
    def _saved_by_autograd(self) -> frozenset[str]:
        return frozenset(name for op in self.ops for name in op.saves)

    @cached_property
    def touched(self) -> tuple[frozenset[str], ...]:
        """Per op, every tensor it reads, holds or writes (the candidates to free after it runs)."""
        return tuple(frozenset({*op.inputs, *op.holds, *(o.name for o in op.outputs)}) for op in self.ops)

    @cached_property
    def release_points(self) -> dict[str, int]:
        """Per saved tensor, the op whose backward frees it: the earliest saver's, which runs last."""
        release_at: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for name in op.saves:
                release_at.setdefault(name, i)
        return release_at


class GraphBuilder:
    """Small helper so graph definitions read like the forward code they mirror."""

    def __init__(self) -> None:
        self.inputs: list[TensorSpec] = []
        self.ops: list[Op] = []

    def input(self, name: str, nbytes: int, kind: str = "activation", requires_grad: bool = True) -> str:
        self.inputs.append(TensorSpec(name, int(nbytes), kind, requires_grad))
        return name

    def op(
        self,
        name: str,
        inputs: tuple[str, ...] | list[str],
        outputs: list[TensorSpec],
        saves: tuple[str, ...] | list[str] = (),
        fwd_workspace: list[Workspace] | None = None,
        bwd_workspace: list[Workspace] | None = None,
        tags: tuple[str, ...] = (),
        grad_passthrough: bool = False,
        holds: tuple[str, ...] | list[str] = (),
        grad_from_saved: str | None = None,
    ) -> Op:
        op = Op(
            name,
            tuple(inputs),
            tuple(outputs),
            tuple(saves),
            tuple(w for w in (fwd_workspace or []) if w.nbytes > 0),
            tuple(w for w in (bwd_workspace or []) if w.nbytes > 0),
            frozenset(tags),
            grad_passthrough,
            tuple(dict.fromkeys(h for h in holds if h not in inputs)),
            grad_from_saved,
        )
        self.ops.append(op)
        return op

    def build(self, outputs: tuple[str, ...], retained: tuple[str, ...] = ()) -> Graph:
        return Graph(tuple(self.inputs), tuple(self.ops), outputs, retained)
