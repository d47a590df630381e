"""Optimizer-state offload (ZeRO-Offload): parameters stay on the device, the optimizer runs on the host.

FSDP2's ``CPUOffloadPolicy`` moves the sharded parameters *and* their gradients and optimizer states to
the host; the plan option ``offload_optimizer`` alone asks for less: device-resident parameters (in
the compute dtype) and gradients, with the fp32 master weights, the optimizer moments and an fp32
gradient copy on the host (the memory model: ``optimizer_host`` 12 B/param for AdamW plus
``host_grad_bytes_per_param`` 4 B/param; nothing of the optimizer on the device).

:class:`HostOffloadOptimizer` wraps any ``torch.optim`` optimizer class. Per ``step()``:

1. each parameter's (local shard of the) gradient is copied into a preallocated fp32 host buffer
   (pinned on CUDA, asynchronous, one stream synchronisation for all of them);
2. the wrapped optimizer steps on the fp32 host master weights;
3. the updated masters are copied back into the device parameters (cast to their dtype,
   asynchronous from pinned memory; the next step's synchronisation orders it before any reuse).

It works on plain parameters and on FSDP2's sharded DTensor parameters (each rank offloads its own
shard, so the host states are sharded like the device ones). It is a ``torch.optim.Optimizer``: LR
schedulers change ``param_groups`` (shared with the wrapped optimizer), ``state_dict`` /
``load_state_dict`` carry the host states, ``zero_grad`` clears the device gradients. Clip gradients
on the device parameters before ``step()``, as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .errors import RuntimeConfigError


#: Key of the fp32 master weights in :meth:`HostOffloadOptimizer.state_dict`.
MASTERS_KEY = "host_master_weights"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class HostOffloadOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` (default AdamW) over fp32 host copies of ``params``; see the module docstring."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        pin_memory: bool | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        self.device_params = [p for p in params if p.requires_grad]
        if not self.device_params:
            raise RuntimeConfigError("HostOffloadOptimizer got no trainable parameters")
        devices = {_local(p).device for p in self.device_params}
        self._cuda = any(d.type == "cuda" for d in devices)
        pin = self._cuda if pin_memory is None else pin_memory
        self.masters: list[torch.Tensor] = []
        self._host_grads: list[torch.Tensor] = []
        for p in self.device_params:
            local = _local(p.detach())
            master = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            master.copy_(local)
            self.masters.append(master.requires_grad_())
            self._host_grads.append(torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=pin))
        self.inner = optimizer_cls(self.masters, **optimizer_kwargs)
        super().__init__(self.masters, self.inner.defaults)
        self._share_with_inner()

    def _share_with_inner(self) -> None:
        # One set of param_groups and state: schedulers and state_dict see (and change) the wrapped optimizer's.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @property
    def host_bytes(self) -> dict[str, int]:
        """Host memory this optimizer holds: fp32 masters, fp32 gradient copies, optimizer states."""
        states = sum(
            v.numel() * v.element_size()
            for s in self.inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return {
            "master_weights": sum(m.numel() * m.element_size() for m in self.masters),
            "gradients": sum(g.numel() * g.element_size() for g in self._host_grads),
            "optimizer_states": states,
        }

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            raise RuntimeConfigError("HostOffloadOptimizer.step does not take a closure; run backward first")
        for p, master, host_grad in zip(self.device_params, self.masters, self._host_grads):
            if p.grad is None:
                master.grad = None
                continue
            host_grad.copy_(_local(p.grad), non_blocking=host_grad.is_pinned())
            master.grad = host_grad
        if self._cuda:
            torch.cuda.synchronize()  # gradients are on the host; last step's parameter copies are done
        self.inner.step()
        for p, master in zip(self.device_params, self.masters):
            _local(p.data).copy_(master, non_blocking=master.is_pinned())
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        for p in self.device_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
        for master in self.masters:
            master.grad = None

    def state_dict(self) -> dict:  # type: ignore[override]
        """The wrapped optimizer's state dict plus the fp32 master weights (the device copies may be bf16)."""
        state = self.inner.state_dict()
        state[MASTERS_KEY] = [m.detach().clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        state = dict(state_dict)
        masters = state.pop(MASTERS_KEY, None)
        self.inner.load_state_dict(state)
        self._share_with_inner()
        with torch.no_grad():
            for i, (p, master) in enumerate(zip(self.device_params, self.masters)):
                # Without saved masters, restart them from the (already restored) device parameters.
                master.copy_(masters[i] if masters is not None else _local(p.detach()))
