"""Liveness simulation of a :class:`~.graph.Graph`: saved bytes and transient peaks, forward and backward.

The rules mirror PyTorch's eager autograd:

- forward: an op allocates its outputs (and briefly its workspace); a tensor is freed after its last
  use unless something keeps it: autograd (it is saved), a checkpoint (it is a kept boundary), the
  next graph (an output) or the step (retained, e.g. logits the caller holds); the mirrored Python code
  may also still reference it (``Op.holds``: a module's input lives until the module returns);
- checkpointing: after forward only the kept tensors stay; backward first re-runs the recompute ops
  (torch's non-reentrant checkpoint recomputes at the first unpack and stops early once every saved
  tensor exists again), which brings back the full set autograd would have saved;
- backward runs the ops in reverse; each allocates gradients for its differentiable inputs (the
  residual add passes its output gradient through without allocating), holds its backward workspace
  while it runs, then drops its output gradients and the saved tensors no earlier op needs. A
  gradient arriving for a tensor that already has one is added in place (PyTorch's InputBuffer
  accumulates into the existing buffer when nothing else references it; the node's incoming gradients
  are released before its outputs are accumulated).

Every result is a :class:`Peak`: the largest sum of live bytes, split by category, and where it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .graph import ATTENTION, CORE_ATTENTION, KINDS, MATMUL, SDPA, Graph, TensorSpec

Mode = Literal["none", "selective", "full", "inference"]


@dataclass(frozen=True)
class Peak:
    """Largest live-bytes sum seen, per category, and the step where it happened."""

    by_kind: dict[str, int]
    at: str

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


@dataclass(frozen=True)
class CheckpointPlan:
    """What stays after forward (``keep``) and which ops backward re-runs (``recompute``)."""

    keep: frozenset[str]
    recompute: tuple[int, ...]


def checkpoint_plan(graph: Graph, mode: Mode, selective_policy: str = "attention_outputs") -> CheckpointPlan:
    """Kept tensors and recomputed ops for a checkpointing mode (see MemoryAssumptions.selective_policy)."""
    ops = graph.ops
    saved = graph.saved_by_autograd()
    inputs = frozenset(t.name for t in graph.inputs if t.requires_grad)
    if mode == "inference":
        return CheckpointPlan(frozenset(), ())
    if mode == "none":
        return CheckpointPlan(frozenset(saved), ())
    if mode == "full":
        keep, candidates = inputs, range(len(ops))
    elif selective_policy == "attention_outputs":
        kept_ops = [i for i, op in enumerate(ops) if ATTENTION in op.tags]
        keep = inputs | {out.name for i in kept_ops for out in ops[i].outputs}
        candidates = [i for i in range(len(ops)) if i not in kept_ops]
    elif selective_policy == "attention_core_recompute":
        core = [i for i, op in enumerate(ops) if CORE_ATTENTION in op.tags]
        core_outputs = {out.name for i in core for out in ops[i].outputs}
        core_inputs = {name for i in core for name in ops[i].inputs if name not in core_outputs}
        used_outside = {name for i, op in enumerate(ops) if i not in core for name in op.inputs}
        keep = (
            inputs
            | {name for i, op in enumerate(ops) if i not in core for name in op.saves}
            | core_inputs
            | (core_outputs & used_outside)
        )
        candidates = core
    elif selective_policy == "op_sac":
        # torchtitan's per-op SAC (_save_list): keep the fused attention kernel's outputs and every other
        # matmul's output (the 1st, 3rd, ... of the block; the even ones are recomputed).
        mms = [i for i, op in enumerate(ops) if MATMUL in op.tags]
        kept_ops = {i for i, op in enumerate(ops) if SDPA in op.tags} | set(mms[0::2])
        keep = inputs | {out.name for i in kept_ops for out in ops[i].outputs}
        candidates = [i for i in range(len(ops)) if i not in kept_ops]
    else:
        raise ValueError(f"unknown selective policy {selective_policy!r}")
    # Early stop: recomputation ends once the last tensor backward needs again has been produced.
    needed = saved - keep
    last_needed = max((i for i in candidates if any(o.name in needed for o in ops[i].outputs)), default=-1)
    recompute = tuple(i for i in candidates if i <= last_needed)
    produced = keep | {o.name for i in recompute for o in ops[i].outputs}
    missing = saved - produced
    if missing:  # a graph definition bug, not a user error
        raise ValueError(f"checkpoint plan for {mode} cannot restore saved tensors {sorted(missing)}")
    return CheckpointPlan(frozenset(keep), recompute)


@dataclass
class _State:
    """Live tensors, gradient storages and running byte totals during a simulation."""

    graph: Graph
    live: dict[str, TensorSpec] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    grad_of: dict[str, int] = field(default_factory=dict)
    storages: dict[int, list] = field(default_factory=dict)  # id -> [nbytes, kind, refcount]
    next_id: int = 0
    peak: Peak = field(default_factory=lambda: Peak(dict.fromkeys(KINDS, 0), "start"))
    # Running sums of ``usage`` and ``peak.by_kind``: observe() runs at every op and builds the
    # per-kind breakdown only when a new peak is reached.
    total: int = 0
    peak_total: int = 0
    #: Allocator events ('a'/'f', key, bytes) when tracing (see :mod:`.allocator`), else None.
    trace: list | None = None

    def alloc(self, spec: TensorSpec) -> None:
        if spec.name not in self.live:
            self.live[spec.name] = spec
            self.usage[spec.kind] += spec.nbytes
            self.total += spec.nbytes
            if self.trace is not None:
                self.trace.append(("a", spec.name, spec.nbytes))

    def free(self, name: str) -> None:
        spec = self.live.pop(name, None)
        if spec is not None:
            self.usage[spec.kind] -= spec.nbytes
            self.total -= spec.nbytes
            if self.trace is not None:
                self.trace.append(("f", name, 0))

    def new_grad(self, nbytes: int, kind: str) -> int:
        sid = self.next_id
        self.next_id += 1
        self.storages[sid] = [nbytes, kind, 0]
        self.usage[kind] += nbytes
        self.total += nbytes
        if self.trace is not None:
            self.trace.append(("a", ("grad", sid), nbytes))
        return sid

    def hold(self, sid: int) -> None:
        self.storages[sid][2] += 1

    def release(self, sid: int) -> None:
        storage = self.storages[sid]
        storage[2] -= 1
        if storage[2] == 0:
            self.usage[storage[1]] -= storage[0]
            self.total -= storage[0]
            del self.storages[sid]
            if self.trace is not None:
                self.trace.append(("f", ("grad", sid), 0))

    def ref(self, name: str, sid: int) -> None:
        self.grad_of[name] = sid
        self.hold(sid)

    def unref(self, name: str) -> None:
        self.release(self.grad_of.pop(name))

    def observe(self, at: str, workspace: tuple = ()) -> None:
        """Record a new peak if live bytes plus the op's temporary ``workspace`` exceed it."""
        if self.trace is not None and workspace:
            keys = [("ws", at, i) for i in range(len(workspace))]
            self.trace.extend(("a", k, w.nbytes) for k, w in zip(keys, workspace))
            self.trace.extend(("f", k, 0) for k in reversed(keys))
        total = self.total + sum(w.nbytes for w in workspace) if workspace else self.total
        if total > self.peak_total:
            current = dict(self.usage)
            for w in workspace:
                current[w.kind] += w.nbytes
            self.peak = Peak(current, at)
            self.peak_total = total


def _forward(state: _State, indices: tuple[int, ...] | range, resident: set[str], label: str) -> None:
    """Run ``indices`` forward; free every tensor after its last use unless it is resident."""
    ops = state.graph.ops
    touched = state.graph.touched
    last_use: dict[str, int] = {}
    for i in indices:
        for name in ops[i].inputs + ops[i].holds:
            last_use[name] = i
    for i in indices:
        op = ops[i]
        for out in op.outputs:
            state.alloc(out)
        state.observe(f"{label}:{op.name}", op.fwd_workspace)
        for name in touched[i]:
            if name not in resident and last_use.get(name, -1) <= i:
                state.free(name)


def _backward(state: _State) -> None:
    """Reverse pass over the whole graph, starting from the output gradients already in ``grad_of``."""
    graph = state.graph
    release_at = graph.release_points
    for i in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[i]
        out_grads = [o.name for o in op.outputs if o.name in state.grad_of]
        if out_grads:
            if op.grad_from_saved is not None:
                state.free(op.grad_from_saved)  # its buffer becomes the input gradient below
            pending: list[tuple[str, int]] = []  # (input, gradient storage)
            for name in dict.fromkeys(op.inputs):
                spec = graph.tensors[name]
                if not spec.requires_grad:
                    continue
                if op.grad_passthrough:
                    pending.append((name, state.grad_of[out_grads[0]]))
                else:
                    pending.append((name, state.new_grad(spec.nbytes, spec.kind)))
            state.observe(f"backward:{op.name}", op.bwd_workspace)
            # The engine drops the node's incoming gradients when the call returns, before it adds the
            # node's outputs into the next input buffers: hold the new gradients, then release.
            for _, sid in pending:
                state.hold(sid)
            for name in out_grads:
                state.unref(name)
            for name, sid in pending:
                old = state.grad_of.get(name)
                if old is None:
                    state.grad_of[name] = sid
                    continue
                if old != sid:
                    # Accumulate: in place when the existing buffer is not shared, else into a new sum.
                    if state.storages[old][2] > 1:
                        nbytes, kind, _ = state.storages[old]
                        total = state.new_grad(nbytes, kind)
                        state.observe(f"backward:{op.name}:accumulate")
                        state.unref(name)
                        state.ref(name, total)
                state.release(sid)
        for name in op.saves:
            if release_at[name] == i:
                state.free(name)


@dataclass(frozen=True)
class GraphMemory:
    """Everything the timeline needs to know about one graph under one checkpointing mode."""

    saved: dict[str, int]
    """Bytes kept after forward (excluding the outputs handed on), per category."""
    saved_tensors: dict[str, int]
    """The same, per tensor name (what a saved_tensors_hooks measurement would list)."""
    retained: dict[str, int]
    """Bytes retained for the rest of the step (logits held by the caller), per category."""
    forward_peak: Peak
    backward_peak: Peak | None
    """None for inference."""
    forward_trace: tuple | None = None
    """Allocator events of the forward (inputs allocated first), when simulated with ``trace=True``."""
    backward_trace: tuple | None = None
    """Allocator events of recompute + backward (starting with the kept tensors and output gradients)."""
    grad_keys: tuple[tuple, tuple] = ((), ())
    """With ``trace``: the trace keys of the output gradients backward starts from and of the inputs'
    gradients it ends with (to chain one graph's backward into the next)."""


def simulate(graph: Graph, mode: Mode, selective_policy: str = "attention_outputs", reentrant: bool = False,
             trace: bool = False) -> GraphMemory:
    """Forward (and, unless ``mode='inference'``, recompute + backward) of one graph.

    ``reentrant`` (full checkpointing only, MemoryAssumptions.checkpoint_implementation): backward
    re-runs every op of the graph, the graph's outputs stay referenced while it runs, and the output
    gradients carry one more reference (the reentrant function's ``args``), so nothing is accumulated
    into them in place. ``trace``: also record the allocator events of forward and backward.
    """
    plan = checkpoint_plan(graph, mode, selective_policy)
    reentrant = reentrant and mode == "full"
    outputs = set(graph.outputs)
    retained = set(graph.retained)
    resident = set(plan.keep) | outputs | retained

    state = _State(graph, trace=[] if trace else None)
    for spec in graph.inputs:
        state.alloc(spec)
    _forward(state, range(len(graph.ops)), resident, "forward")
    forward_peak = state.peak

    kept = {name: spec for name, spec in state.live.items() if name not in outputs and name not in retained}
    saved = dict.fromkeys(KINDS, 0)
    for spec in kept.values():
        saved[spec.kind] += spec.nbytes
    retained_bytes = dict.fromkeys(KINDS, 0)
    for name in retained:
        spec = graph.tensors[name]
        retained_bytes[spec.kind] += spec.nbytes
    forward_trace = tuple(state.trace) if trace else None
    if mode == "inference":
        return GraphMemory(saved, {n: s.nbytes for n, s in kept.items()}, retained_bytes, forward_peak, None,
                           forward_trace, None)

    # Backward starts from the kept tensors, whatever is retained, and the gradients of the outputs.
    back = _State(graph, trace=[] if trace else None)
    for name, spec in kept.items():
        back.alloc(spec)
    for name in retained:
        back.alloc(graph.tensors[name])
    out_grad_keys = []
    for name in graph.outputs:
        spec = graph.tensors[name]
        if spec.requires_grad:
            sid = back.new_grad(spec.nbytes, spec.kind)
            back.ref(name, sid)
            out_grad_keys.append(("grad", sid))
            if reentrant:
                back.hold(sid)  # the reentrant function's `args` keeps the incoming gradient
    back.observe("backward:start")
    recompute = tuple(range(len(graph.ops))) if reentrant else plan.recompute
    if recompute:
        # Recompute brings back what autograd saves. A kept output nothing saves (a selective cache entry)
        # is consumed by the recompute and dies with it; the block input stays with the checkpoint. A
        # reentrant recompute runs the whole graph and keeps its outputs referenced until backward ends.
        inputs = {t.name for t in graph.inputs}
        restore = graph.saved_by_autograd() | (set(plan.keep) & inputs) | retained
        if reentrant:
            restore |= outputs
        _forward(back, recompute, restore, "recompute")
        for name in set(plan.keep) - restore:
            back.free(name)
    _backward(back)
    in_grad_keys = tuple(("grad", back.grad_of[t.name]) for t in graph.inputs if t.name in back.grad_of)
    return GraphMemory(
        saved, {n: s.nbytes for n, s in kept.items()}, retained_bytes, forward_peak, back.peak,
        forward_trace, tuple(back.trace) if trace else None, (tuple(out_grad_keys), in_grad_keys),
    )
