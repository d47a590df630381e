"""Peak of live tensor bytes while a function runs, on CPU (profiler timeline) or CUDA (allocator stats).

The memory model predicts transient peaks (inside a block's forward, recompute and backward; inside the
loss). To check them on any machine, :func:`live_peak` reports the largest number of bytes allocated
above the starting point while ``fn`` runs:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the bytes
  allocated at the start (the caching allocator's view: rounded to its 512-byte blocks);
- CPU: the allocation timeline of ``torch.profiler`` with ``profile_memory=True`` (every allocation
  and free with its size, in order), summed and maximised (exact tensor sizes).

Both count only tensors allocated and freed through PyTorch's allocators (no Python objects, no
communication library buffers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def live_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Largest sum of bytes allocated minus freed, above the starting point, while ``fn()`` runs."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    import gc

    from torch.profiler import ProfilerActivity, profile

    # Python's cyclic GC would free whatever garbage it finds whenever its counters say so: tensors
    # of earlier work (or of fn's own reference cycles) would then vanish at a point that depends on
    # everything that ran before, and the measured peak with them. Collect first, pause it inside.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        gc.enable()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
