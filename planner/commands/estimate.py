"""``sp-plan estimate``: the per-GPU memory breakdown of one layout, as a table or JSON."""

from __future__ import annotations

import json
from typing import Any

import click
from pydantic import ValidationError

from cost_models.errors import CostModelError, explain_validation_error
from cost_models.estimate import Estimate, estimate
from cost_models.units import GB, GiB, format_tokens

from .common import (
    build_gpu,
    build_layout,
    build_model,
    build_train,
    hardware_options,
    layout_options,
    model_options,
    split_options,
)


def check_nodes(gpus: int, gpus_per_node: int | None) -> int:
    """GPUs per node (default min(8, gpus)); a multi-node job must fill whole nodes."""
    per_node = gpus_per_node or min(8, gpus)
    if gpus > per_node and gpus % per_node:
        raise CostModelError(
            f"--gpus {gpus} does not fill whole nodes of --gpus-per-node {per_node}; use a multiple of {per_node}"
        )
    return per_node


def run_estimate(model_name: str, gpus: int, gpus_per_node: int | None, gpu_name: str,
                 options: dict[str, Any]) -> Estimate:
    """Build the specs from CLI values and estimate; pydantic errors become one-line CostModelErrors."""
    try:
        check_nodes(gpus, gpus_per_node)
        train_kwargs, layout_kwargs = split_options(options)
        model = build_model(model_name)
        train = build_train(**train_kwargs)
        gpu = build_gpu(gpu_name)
        layout = build_layout(gpus, **layout_kwargs)
        return estimate(model, train, layout, gpu)
    except ValidationError as exc:
        raise explain_validation_error(exc, "input") from exc


@click.command("estimate")
@model_options
@hardware_options
@layout_options
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON (bytes).")
def command(model_name: str, gpus: int, gpus_per_node: int | None, gpu_name: str, as_json: bool,
            **options: Any) -> None:
    """Per-GPU memory of one layout: weights, gradients, optimizer, activations, logits, KV cache,
    buffers and overheads at the peak phase of the step, whether it fits, and host memory."""
    result = run_estimate(model_name, gpus, gpus_per_node, gpu_name, options)
    if as_json:
        click.echo(json.dumps(result.to_json_dict(), indent=2))
    else:
        click.echo(render_table(result))


def _gb(n: float) -> str:
    return f"{n / GB:10.2f} {n / GiB:10.2f}"


def render_table(est: Estimate) -> str:
    """Readable breakdown: each component in GB and GiB, the peak phase and what decides it."""
    mem, det = est.memory, est.detail
    layout = est.layout.describe()
    kernel_line = (
        f"{det.model} | {det.mode} | {format_tokens(det.seq_len)} tokens x {det.micro_batch} | {det.dtype} | "
        f"{est.layout.world} x {det.gpu} | {layout}"
    )
    rows = [kernel_line, f"{'per GPU':<28}{'GB':>11}{'GiB':>11}"]
    for name in ("weights", "gradients", "optimizer", "activations", "logits", "kv_cache", "buffers"):
        rows.append(f"  {name:<26}{_gb(getattr(mem, name))}")
    rows.append(f"  {'= peak allocated':<26}{_gb(mem.peak_allocated)}")
    o = det.overhead
    comms = ", ".join(f"{c.name}({c.size})" for c in o.communicators) or "none"
    rows.append(f"  {'overhead':<26}{_gb(mem.overhead)}")
    rows.append(f"    {'CUDA context':<24}{_gb(o.cuda_context)}")
    rows.append(f"    {'NCCL':<24}{_gb(o.nccl)}   {len(o.communicators)} communicator(s): {comms}")
    rows.append(f"    {'fragmentation':<24}{_gb(o.fragmentation)}")
    rows.append(f"  {'= total':<26}{_gb(mem.total)}")
    rows.append(f"  {'capacity':<26}{_gb(mem.capacity)}")
    margin = mem.capacity - mem.total
    verdict = f"fits, {margin / GB:.2f} GB to spare" if est.fits else f"does NOT fit: short by {-margin / GB:.2f} GB"
    rows.append(f"{verdict}; peak phase: {det.peak_phase} (at {det.phases[det.peak_phase].transient_peak_at})")
    rows.append("phases (allocated GB): " + ", ".join(f"{n} {p.allocated / GB:.2f}" for n, p in det.phases.items()))
    b = det.buffers
    rows.append(
        f"buffers: comm staging {b.comm_staging / GB:.2f} GB, ZeRO-3 gathered params "
        f"{b.zero3_gathered_params / GB:.2f} GB, unsharded grads {b.unsharded_grads / GB:.2f} GB"
    )
    h = est.host_memory
    if h.total:
        rows.append(
            f"host memory: {h.total / GB:.2f} GB (weights {h.weights / GB:.2f}, gradients {h.gradients / GB:.2f}, "
            f"optimizer {h.optimizer / GB:.2f}, checkpoints {h.checkpoints / GB:.2f})"
        )
    else:
        rows.append("host memory: nothing offloaded")
    pl = det.per_layer
    if det.mode == "train":
        modes = ", ".join(f"{k} {v / GB:.3f}" for k, v in pl.saved_bytes_by_mode.items())
        rows.append(
            f"per layer: saved {pl.saved_bytes / GB:.3f} GB ({pl.checkpointing}; by mode: {modes}); "
            f"block forward peak {pl.forward_peak_bytes / GB:.2f} GB, "
            f"backward peak {pl.backward_peak_bytes / GB:.2f} GB"
        )
    else:
        rows.append(
            f"per layer: KV cache {det.kv_cache_per_layer / GB:.3f} GB; block forward peak "
            f"{pl.forward_peak_bytes / GB:.2f} GB (at {pl.forward_peak_at})"
        )
    u = det.ulysses
    if u.degree > 1:
        rows.append(
            f"ulysses all-to-all per GPU: Q {u.q_bytes_before / GB:.2f} -> {u.q_bytes_after / GB:.2f} GB, "
            f"K {u.k_bytes_before / GB:.2f} -> {u.k_bytes_after / GB:.2f} GB, V {u.v_bytes_before / GB:.2f} -> "
            f"{u.v_bytes_after / GB:.2f} GB; tokens {u.tokens_before:,} -> {u.tokens_after:,}; KV heads "
            f"{u.kv_heads_before} -> {u.kv_heads_after} (replication x{u.kv_replication})"
        )
    return "\n".join(rows)
