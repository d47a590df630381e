"""A pipelined step metered inside its schedule: saved activations micro-batch by micro-batch, and P2P sends.

Under pipeline parallelism a stage runs the forward of several micro-batches before their backwards (1F1B's
warm-up: stage ``s`` of ``p`` holds up to ``min(p - s, m)`` of them), so what a stage holds at its peak is
what the schedule keeps alive, not one micro-batch's forward run on its own. :class:`ScheduleMeter`
wraps each of this rank's :class:`~torch.distributed.pipelining.PipelineStage` objects while the ``with``
block runs (their ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``, and the
schedule's loss function) and, for every (stage, micro-batch):

- meters the tensors its forward (and, on the last stage, its loss) saves for backward with
  :class:`~sp_plan.runtime.validate_meters.ParameterAwareMeter` (storages deduplicated, parameters and FSDP2's
  gathered parameters excluded);
- keeps them counted as live until the schedule has run that micro-batch's whole backward (the full
  backward, or under zero-bubble schedules the input-gradient part and then the weight-gradient part);
- records the peak of the live bytes (a storage two micro-batches share counted once) and the most
  micro-batch chunks alive at once.

It also sums the tensors the stages hand to their point-to-point sends (``get_fwd_send_ops`` /
``get_bwd_send_ops``: every activation sent forward and gradient sent back), which the schedule posts right
after; ring attention's own sends, inside the stages' compute, are not among them.

The wrappers are instance attributes removed on exit; the schedule and the stages run unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sp_plan.runtime.validate_meters import ParameterAwareMeter

#: A chunk of work: (global stage index, micro-batch index).
Chunk = tuple[int, int]


@dataclass
class ScheduleMeter:
    """``with ScheduleMeter(setup.pipeline) as meter: train_step(setup, ...)``; then :meth:`microbatch_bytes`,
    :attr:`peak_bytes`, :attr:`peak_chunks`, :attr:`send_bytes` and :attr:`sends`."""

    pipeline: Any
    #: Bytes of every storage each chunk saved (its forward and, on the last stage, its loss).
    saved: dict[Chunk, dict[int, int]] = field(default_factory=dict)
    #: Largest sum of live saved bytes over the step (storages counted once).
    peak_bytes: int = 0
    #: Most chunks whose saved activations were alive at once (a chunk: one micro-batch on one stage).
    peak_chunks: int = 0
    #: Bytes of the tensors this rank's stages sent to their neighbours, and how many sends.
    send_bytes: int = 0
    sends: int = 0

    def __post_init__(self) -> None:
        self._live: dict[Chunk, dict[int, int]] = {}
        self._last_forward: dict[int, int] = {}
        #: (owner, attribute, the owner's own value before wrapping or None when it was the class's method)
        self._wrapped: list[tuple[object, str, Any]] = []

    # -- the figures ----------------------------------------------------------------------------------------
    def microbatch_bytes(self, microbatch: int = 0) -> int:
        """Saved bytes of one micro-batch on all of this rank's stages (storages counted once per stage)."""
        return sum(sum(storages.values()) for (_, mb), storages in self.saved.items() if mb == microbatch)

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _live_bytes(self) -> int:
        unique: dict[int, int] = {}
        for storages in self._live.values():
            unique.update(storages)
        return sum(unique.values())

    def _add(self, chunk: Chunk, meter: ParameterAwareMeter) -> None:
        storages = {ptr: s.nbytes for ptr, s in meter.storages.items()}
        self.saved.setdefault(chunk, {}).update(storages)
        self._live.setdefault(chunk, {}).update(storages)
        self.peak_bytes = max(self.peak_bytes, self._live_bytes())
        self.peak_chunks = max(self.peak_chunks, len(self._live))

    def _release(self, chunk: Chunk) -> None:
        self._live.pop(chunk, None)

    # -- wrappers -------------------------------------------------------------------------------------------
    def _metered(self, stage, run: Callable[[], Any], chunk: Chunk) -> Any:
        with ParameterAwareMeter(stage.submod) as meter:
            out = run()
        self._add(chunk, meter)
        return out

    def _wrap(self, owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
        own = vars(owner).get(name)
        setattr(owner, name, make(getattr(owner, name)))
        self._wrapped.append((owner, name, own))

    def _wrap_stage(self, stage) -> None:
        index = stage.stage_index

        def forward(original):
            def run(fwd_chunk_id, *args, **kwargs):
                self._last_forward[index] = fwd_chunk_id
                return self._metered(stage, lambda: original(fwd_chunk_id, *args, **kwargs), (index, fwd_chunk_id))
            return run

        def backward(original):
            signature = inspect.signature(original)

            def run(*args, **kwargs):
                out = original(*args, **kwargs)
                bound = signature.bind(*args, **kwargs).arguments
                if bound.get("full_backward", True):
                    self._release((index, bound["bwd_chunk_id"]))
                return out
            return run

        def weight_backward(original):
            def run(bwd_chunk_id, *args, **kwargs):
                out = original(bwd_chunk_id, *args, **kwargs)
                self._release((index, bwd_chunk_id))
                return out
            return run

        def send_ops(original):
            def run(*args, **kwargs):
                ops = original(*args, **kwargs)
                self.send_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                self.sends += len(ops)
                return ops
            return run

        self._wrap(stage, "get_fwd_send_ops", send_ops)
        self._wrap(stage, "get_bwd_send_ops", send_ops)
        self._wrap(stage, "forward_one_chunk", forward)
        self._wrap(stage, "backward_one_chunk", backward)
        self._wrap(stage, "backward_weight_one_chunk", weight_backward)

    def _wrap_loss(self) -> None:
        last = next((stage for stage in self.pipeline.stages if stage.is_last), None)
        if last is None:
            return

        def loss(original):
            def run(*args, **kwargs):
                chunk = (last.stage_index, self._last_forward.get(last.stage_index, 0))
                return self._metered(last, lambda: original(*args, **kwargs), chunk)
            return run

        self._wrap(self.pipeline.schedule, "_loss_fn", loss)

    def __enter__(self) -> ScheduleMeter:
        for stage in self.pipeline.stages:
            self._wrap_stage(stage)
        self._wrap_loss()
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._wrapped):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._wrapped.clear()
