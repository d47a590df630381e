"""The process group's lifecycle and the collectives the set-up needs: start it, end a worker cleanly,
start every rank from rank 0's weights, and the data-parallel group the loss reduces over."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from sp_plan.cost_models import degrees
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.mesh import RuntimeMesh, init_default_group


def init_distributed(device_type: str | None = None) -> str:
    """Initialise the default process group from torchrun's environment (or a 1-rank group); returns
    the device type. NCCL (plus gloo for CPU tensors) on CUDA, gloo on CPU."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise RuntimeConfigError(f"device_type {device_type!r} is not supported: use 'cuda' or 'cpu'")
    if dist.is_initialized():
        return device_type
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_default_group(device_type)
    return device_type


def finish_worker(code: int = 0) -> None:
    """End a torchrun worker: barrier, destroy the process group, flush, and leave without the interpreter's
    teardown (``os._exit``).

    Why not a normal exit: a gloo worker thread releases a finished collective's work object (and with it
    the Python tensors it held) slightly after ``wait()`` has returned on the main thread. If the
    interpreter is finalizing by then, dropping those tensors must take the GIL, CPython ends the thread
    (``PyThread_exit_thread``), and the forced unwind through a ``noexcept`` C++ frame calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT, and torchrun reports the
    finished job as failed. Captured in a core dump (``ProcessGroupGloo::runLoop`` ->
    ``~AsyncBarrierWork`` -> ``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil``
    during ``Py_FinalizeEx``); 1 abort in 180 launches of the 4-rank attention example, about 1 in 15 for
    the training example. ``destroy_process_group`` does not prevent it while any object still refers to
    a group (the device mesh does), so the process leaves before finalization. Files must be closed before
    this (checkpoints, TensorBoard, metrics: the trainer closes them).
    """
    if dist.is_initialized():
        dist.barrier()  # gloo tears down badly if a rank leaves while others still talk
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast_parameters(model_parts: Iterable[nn.Module], device: torch.device) -> None:
    """Make every rank start from rank 0's weights (FSDP2 keeps each rank's own slice of its own copy)."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for part in model_parts:
            for tensor in itertools.chain(part.parameters(), part.buffers()):
                if tensor.device.type == "meta":
                    raise RuntimeConfigError(
                        "the model has meta-device tensors: materialise it (same seed on every rank) before "
                        "auto_configure, or pass sync_weights=False and initialise after sharding"
                    )
                staged = tensor.detach().to(device)
                dist.broadcast(staged, src=0)
                tensor.copy_(staged)


def data_group(mesh: RuntimeMesh) -> dist.ProcessGroup | None:
    """Every rank that holds the same weights but different tokens: all mesh dims but the weight-splitting
    ones (tp), i.e. the whole world without TP, which needs no extra communicator."""
    dims = degrees.without_role("weights")
    if all(mesh.size(d) == 1 for d in dims):
        return None
    if all(mesh.size(d) == 1 for d in degrees.with_role("weights")):
        return dist.group.WORLD
    return mesh.device_mesh[dims]._flatten("data").get_group()
