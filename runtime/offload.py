"""Checkpointed hidden-state offload: each block's checkpointed input lives in host memory until backward.

With activation checkpointing a block keeps only its input (plus, under ``selective``, the attention
outputs) between forward and backward, ``layers x tokens x hidden x 2`` bytes per GPU: at 1M tokens
on 8 GPUs for an 80-layer 8192-wide model that is 21 GB, the largest activation term left. ALST
(Snowflake's Arctic long sequence training) and DeepSpeed's checkpoint offload move it to host memory.

How: non-reentrant ``torch.utils.checkpoint`` keeps its inputs as autograd ``SavedTensor``s, created
*before* it installs its own hooks, so an outer ``saved_tensors_hooks`` around the checkpoint call sees
exactly the inputs it keeps, and nothing the block saves inside (those go through the checkpoint's
hooks). :meth:`CheckpointOffload.saving` installs such hooks around one block's checkpoint call and
packs only the block input (the hidden states; RoPE tables shared by all layers stay where they are):

- CUDA: the copy to a pinned host buffer runs on a side stream (``non_blocking``) after waiting for the
  compute stream, and the device tensor is marked used by that stream (``record_stream``), so the
  caching allocator reuses its memory only after the copy finished, without blocking compute. In
  backward, the first unpack of a block's input copies it back on the side stream and makes the
  compute stream wait for it; it also starts copying back the input of the block that backward
  reaches next (prefetch), so at most two blocks' inputs are on the device at once (the one in use
  and the one arriving: ``MemoryAssumptions.checkpoint_offload_in_flight = 2``).
- CPU (and other devices): the input is copied into a separate host buffer and the original released,
  so the bookkeeping, the hooks and the gradients are exercised exactly as on a GPU.

Gradients are exact: the values come back bit for bit, and the checkpoint recomputes from them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import RuntimeConfigError


@dataclass(eq=False)
class _Offloaded:
    """One block input in host memory (and, once prefetched, its way back to the device)."""

    host: torch.Tensor
    device: torch.device
    nbytes: int
    #: CUDA: the device copy made by a prefetch, and the event that marks it complete.
    prefetched: torch.Tensor | None = None
    ready: object | None = None
    owner: weakref.ref | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Passed:
    """A saved tensor packed by the hooks that were active outside ours."""

    value: object


def _outer_hooks():
    """The saved-tensor hooks active before ours (None if none, or if this torch cannot tell)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The tensor autograd saves may be a new Python object over the caller's tensor."""
    if a is b:
        return True
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


class CheckpointOffload:
    """Moves checkpointed block inputs to host memory; one instance is shared by all blocks of a model.

    ``pin_memory`` (default: on CUDA) makes host buffers page-locked, which asynchronous copies need.
    ``prefetch`` starts bringing back the next block's input while the current block is differentiated.
    Counters (bytes): :attr:`host_bytes` now, :attr:`peak_host_bytes`, :attr:`offloaded_bytes` in total.
    """

    def __init__(self, *, pin_memory: bool | None = None, prefetch: bool = True) -> None:
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref] = []  # offloaded entries in forward order, still awaiting backward

    # ----- hooks -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, block_input: torch.Tensor) -> Iterator[None]:
        """Around one block's checkpoint call: its saved ``block_input`` goes to host memory.

        Other saved tensors are handed to the hooks that were active outside (e.g. a
        :class:`sp_plan.runtime.saved_tensor_meter.SavedTensorMeter`), so hooks compose.
        """
        outer = _outer_hooks()

        def pack(tensor: torch.Tensor):
            if isinstance(tensor, torch.Tensor) and _same_tensor(tensor, block_input):
                return self._offload(tensor)
            return _Passed(outer[0](tensor)) if outer is not None else tensor

        def unpack(packed):
            if isinstance(packed, _Passed):
                return outer[1](packed.value)
            return self._restore(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _offload(self, tensor: torch.Tensor) -> _Offloaded:
        device = tensor.device
        nbytes = tensor.numel() * tensor.element_size()
        pin = self.pin_memory if self.pin_memory is not None else device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        if device.type == "cuda":
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the tensor is complete
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=pin)
            tensor.record_stream(stream)  # its memory is reused only after the copy finished
        else:
            host.copy_(tensor)
        entry = _Offloaded(host, device, nbytes)
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.offloaded_bytes += nbytes
        self.offloaded_tensors += 1
        weakref.finalize(entry, self._release, nbytes)
        self._order.append(weakref.ref(entry))
        return entry

    def _release(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _restore(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self._forget(packed)
        if packed.device.type != "cuda":
            return packed.host
        current = torch.cuda.current_stream(packed.device)
        if packed.prefetched is None:
            self._copy_back(packed)
        tensor, event = packed.prefetched, packed.ready
        packed.prefetched = packed.ready = None
        current.wait_event(event)
        tensor.record_stream(current)  # allocated on the side stream, used and freed on the compute stream
        return tensor

    def _forget(self, packed: _Offloaded) -> None:
        """Drop ``packed`` from the pending list and prefetch the entry backward reaches next."""
        alive = [ref for ref in self._order if ref() is not None]
        index = next((i for i, ref in enumerate(alive) if ref() is packed), None)
        if index is not None:
            del alive[index]
            if self.prefetch and index > 0:
                previous = alive[index - 1]()
                if previous is not None and previous.device.type == "cuda" and previous.prefetched is None:
                    self._copy_back(previous)
        self._order = alive

    def _copy_back(self, packed: _Offloaded) -> None:
        stream = self._side_stream(packed.device)
        with torch.cuda.stream(stream):
            tensor = torch.empty(packed.host.shape, dtype=packed.host.dtype, device=packed.device)
            tensor.copy_(packed.host, non_blocking=packed.host.is_pinned())
            event = torch.cuda.Event()
            event.record(stream)
        packed.prefetched, packed.ready = tensor, event


def apply_checkpoint_offload(model: torch.nn.Module, *, pin_memory: bool | None = None,
                             prefetch: bool = True) -> CheckpointOffload:
    """Offload the checkpointed input of every block of ``model`` (a :class:`sp_plan.runtime.models.LlamaModel`).

    Blocks must be checkpointed (``selective`` or ``full``): with ``none`` there is no checkpointed input,
    autograd keeps every activation. Call after the checkpointing mode is set; FSDP2 wrapping before or
    after does not matter (the hooks live inside the block's forward).
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        raise RuntimeConfigError(f"{type(model).__name__} has no 'layers': pass a runtime LlamaModel")
    offload = CheckpointOffload(pin_memory=pin_memory, prefetch=prefetch)
    for i, layer in enumerate(layers):
        if layer.checkpointing == "none":
            raise RuntimeConfigError(
                f"block {i} is not checkpointed (checkpointing 'none'), so it has no checkpointed input to "
                "offload; set checkpointing to 'full' or 'selective' first"
            )
        layer.checkpoint_offload = offload
    return offload
