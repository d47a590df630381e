"""Checkpoints saved while training goes on: the state is copied to host buffers at the step, and a
background thread writes it.

A synchronous save stops every rank for as long as its chunk takes to reach storage (a 70B model's
weights and Adam states are ~17 GB per rank on 64 ranks: tens of seconds at a shared file system's
per-client bandwidth). :class:`AsyncCheckpointer` stops training only for
:func:`sp_plan.runtime.checkpoint.prepare_save` (the RNG files and bookkeeping) and one device-to-host copy of
this rank's chunks; DCP's write, the hashing of what was written, the manifest, the atomic rename, the
re-read verification and the pruning then run in a thread (:func:`sp_plan.runtime.checkpoint.commit_save`, the
code path of synchronous saves). The files are exactly those of
:func:`sp_plan.runtime.checkpoint.save_checkpoint`, with the same guarantees: a checkpoint is visible only once
every rank's chunks are written and its manifest is complete, and nothing older is pruned before it has
been read back and verified. hashlib releases the GIL while it hashes, so training goes on meanwhile.

- **One save in flight.** A new save (or :meth:`AsyncCheckpointer.wait`) first waits for the previous
  one, so a run never holds two staged copies and a slow file system shows as a longer save, not a
  growing queue.
- **Staging buffers** are kept between saves and reused when shapes match: one host copy of the
  rank's chunks (pinned when they live on a GPU), what the async save costs in host memory.
- **Its own process group.** The thread's collectives (DCP's plan exchange, the final barrier and the
  error broadcast) run on a gloo group made for it, never on the group training uses, so they cannot
  interleave with training's collectives. Creating it is collective: every rank makes the same saves.
- **Errors** raised in the thread (a full disk, a rank that failed, a checkpoint that does not verify
  once written: :class:`sp_plan.runtime.checkpoint.CheckpointCorruptError`, which names the file and chunk)
  are raised by the next :meth:`~AsyncCheckpointer.save` or :meth:`~AsyncCheckpointer.wait`, as
  :class:`RuntimeConfigError`; the previous checkpoint is then still there.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sp_plan.runtime.checkpoint.geometry import Chunk
from sp_plan.runtime.checkpoint.manager import SaveJob, commit_save, prepare_save
from sp_plan.runtime.errors import RuntimeConfigError


class AsyncCheckpointer:
    """Saves checkpoints in the background, one at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._group: dist.ProcessGroup | None = None
        self._group_of: object | None = None  # the default group the private one was made beside

    def save(self, directory: str | os.PathLike, **kwargs: Any) -> Path:
        """Start saving (collective); takes :func:`sp_plan.runtime.checkpoint.save_checkpoint`'s keyword arguments.

        Returns the path the checkpoint will have once complete; it returns after the state has been copied
        to host memory, so the caller may change parameters and optimizer states right away.
        """
        self.wait()
        job = prepare_save(directory, **kwargs)
        if isinstance(job, Path):  # that step is already saved
            return job
        group = self._private_group()
        staged = replace(job, entries=self._stage(job.entries))
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(staged, group), name="sp-plan-checkpoint",
                                        daemon=True)
        self._thread.start()
        return job.final

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is complete; its path, or None when none was in flight."""
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, RuntimeConfigError):
                raise error
            raise RuntimeConfigError(f"saving a checkpoint in the background failed: "
                                     f"{type(error).__name__}: {error}") from error
        return self._result

    def _run(self, job: SaveJob, group: dist.ProcessGroup | None) -> None:
        try:
            self._result = commit_save(job, group)
        except BaseException as exc:  # re-raised in the training thread by wait()
            self._error = exc

    def _private_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        world = dist.group.WORLD
        if self._group is None or self._group_of is not world:  # new process group after a re-init
            self._group, self._group_of = dist.new_group(backend="gloo"), world
        return self._group

    def _stage(self, entries: dict[str, Chunk]) -> dict[str, Chunk]:
        """Host copies of the chunks, in reused buffers (pinned for device tensors); synchronised, so the
        training thread may overwrite the originals when this returns."""
        staged: dict[str, Chunk] = {}
        cuda = False
        for name, chunk in entries.items():
            source = chunk.tensor.detach()
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                pin = source.is_cuda
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
                self._buffers[name] = buffer
            buffer.copy_(source, non_blocking=source.is_cuda)
            cuda = cuda or source.is_cuda
            staged[name] = replace(chunk, tensor=buffer)
        for name in set(self._buffers) - set(entries):  # parameters that no longer exist
            del self._buffers[name]
        if cuda:
            torch.cuda.synchronize()
        return staged
