"""Per-GPU memory model: model states, activations, logits, KV cache, buffers and overheads.

Modules, one job each: :mod:`.assumptions` (every implementation choice, documented), :mod:`.dims`
(per-GPU shapes after TP/Ulysses/Ring), :mod:`.states` (weights, gradients, optimizer under ZeRO and
offload), :mod:`.graph` + :mod:`.block` + :mod:`.output_layer` (what a block and the loss execute, op by
op), :mod:`.liveness` (saved bytes and transient peaks from those graphs, and their allocator events),
:mod:`.allocator` (PyTorch's caching allocator replayed on those events), :mod:`.overhead` (CUDA context,
NCCL communicators, fragmentation), :mod:`.timeline` (phases of a step and the peak) and :mod:`.report`
(result types).
"""

from .assumptions import MemoryAssumptions
from .report import HostMemory, MemoryBreakdown, MemoryDetail, MemoryReport
from .timeline import MemoryCore, host_memory, memory_core, memory_report

__all__ = ["HostMemory", "MemoryAssumptions", "MemoryBreakdown", "MemoryDetail", "MemoryCore", "MemoryReport", "host_memory", "memory_core", "memory_report"]
