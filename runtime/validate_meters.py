"""Meters ``sp-plan validate`` reads on every rank, beyond :class:`~sp_plan.runtime.comm_counter.CommCounter`.

- :class:`C10dTrace`: the bytes this rank sends in FSDP2's all-gathers and reduce-scatters, seen at the
  dispatcher (they run inside FSDP2's hooks, where no runtime call site can report them);
- :class:`ParameterAwareMeter`: activation bytes saved for backward, FSDP2's gathered parameters excluded.
"""

from __future__ import annotations

import torch
from sp_plan.runtime.saved_tensor_meter import SavedTensorMeter
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: The report's communication rows. SP and loss ones come from CommCounter, FSDP ones from C10dTrace.
SP_COLLECTIVES = ("all_to_all", "send_recv")
FSDP_COLLECTIVES = ("all_gather", "reduce_scatter")
LOSS_ROW = "all_reduce (loss)"
#: Tensor parallelism's traffic (all-gathers, reduce-scatters, all-reduces) as one row.
TP_ROW = "tp (all collectives)"
#: Pipeline stages' point-to-point sends (activations forward, gradients back), from the schedule meter.
PIPELINE_ROW = "pipeline (P2P sends)"


# ----- FSDP traffic at the dispatcher ---------------------------------------------------------------------


class C10dTrace(TorchDispatchMode):
    """Bytes this rank sends in c10d all-gathers and reduce-scatters (FSDP2's), by the project's conventions.

    FSDP2 issues them from its hooks through ``torch.distributed``; they reach the dispatcher as c10d ops
    (``_allgather_base_``, ``_reduce_scatter_base_`` and coalesced variants), where this mode sees them.
    All-gather: the local shard goes to P-1 peers; reduce-scatter: (P-1)/P of the full input. P follows
    from the output/input sizes, so no process group lookup is needed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = dict.fromkeys(FSDP_COLLECTIVES, 0)
        self.calls = dict.fromkeys(FSDP_COLLECTIVES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("c10d::"):
            self._record(name, args)
        return func(*args, **(kwargs or {}))

    def _record(self, name: str, args: tuple) -> None:
        tensors = [a for a in args[:2]]
        outs = tensors[0] if isinstance(tensors[0], (list, tuple)) else [tensors[0]]
        ins = tensors[1] if isinstance(tensors[1], (list, tuple)) else [tensors[1]]
        if not all(isinstance(t, torch.Tensor) for t in [*outs, *ins]):
            return
        out_bytes = sum(t.numel() * t.element_size() for t in outs)
        in_bytes = sum(t.numel() * t.element_size() for t in ins)
        if "allgather" in name and in_bytes:
            world = out_bytes // in_bytes
            self.bytes["all_gather"] += in_bytes * (world - 1)
            self.calls["all_gather"] += 1
        elif "reduce_scatter" in name and out_bytes:
            world = in_bytes // out_bytes
            self.bytes["reduce_scatter"] += in_bytes * (world - 1) // world
            self.calls["reduce_scatter"] += 1


# ----- saved activations under FSDP2 ----------------------------------------------------------------------


class ParameterAwareMeter(SavedTensorMeter):
    """A SavedTensorMeter that also skips the parameters FSDP2 gathers for a module's forward.

    FSDP2 swaps each module's sharded parameters for freshly gathered full ones just before the
    module runs and frees them after, so their storages are unknown in advance and their addresses are
    reused later: a forward pre-hook excludes a module's parameter storages while the module runs and a
    forward hook lifts the exclusion (parameters a linear layer saves for backward are the weights,
    not activations).
    """

    def __init__(self, model: nn.Module) -> None:
        # FSDP2's sharded parameters are DTensors: their local shards own the storage.
        super().__init__(exclude=[getattr(p, "_local_tensor", p) for p in model.parameters()])
        self._model = model
        self._module_hooks: list = []
        self._permanent = set(self._excluded)
        self._running: dict[int, int] = {}
        self._by_module: dict[int, list[int]] = {}

    def _parameter_storages(self) -> set[int]:
        return {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in self._model.parameters()}

    def _record(self, tensor: torch.Tensor, source: str) -> None:
        # A parameter that was gathered when the meter started (under pipeline parallelism FSDP2 keeps a stage's
        # root parameters gathered between micro-batches) may be resharded meanwhile and its storage reused by an
        # activation: an exclusion holds only while the storage still is a parameter's (or a running module's).
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in self._permanent and ptr not in self._running and ptr not in self._parameter_storages():
                self._permanent.discard(ptr)
                self._excluded.discard(ptr)
        super()._record(tensor, source)

    def _pre(self, module, _args) -> None:
        # Remembered per module: after the forward FSDP2 has freed (resharded) these parameters.
        ptrs = [p.untyped_storage().data_ptr() for p in module.parameters(recurse=False)]
        self._by_module[id(module)] = ptrs
        for ptr in ptrs:
            self._running[ptr] = self._running.get(ptr, 0) + 1
            self._excluded.add(ptr)

    def _post(self, module, _args, _output) -> None:
        for ptr in self._by_module.pop(id(module), []):
            self._running[ptr] -= 1
            if self._running[ptr] == 0:
                del self._running[ptr]
                if ptr not in self._permanent:
                    self._excluded.discard(ptr)

    def __enter__(self) -> ParameterAwareMeter:
        for module in self._model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._module_hooks.append(module.register_forward_pre_hook(self._pre))
                self._module_hooks.append(module.register_forward_hook(self._post))
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks.clear()
