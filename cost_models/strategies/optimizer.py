"""The optimizer step: memory-bound AdamW on the GPU, or on the host CPU for offloaded state.

Each GPU steps its ZeRO shard of its TP-local parameters (:func:`.fsdp.local_optimizer_params`). The
part whose state is on the host (:func:`.offload.host_optimizer_params`) runs on the CPU at the slower
of host-memory bandwidth and the stack's per-core optimizer throughput over the GPU's share of the
cores. The step is exposed: nothing overlaps it.
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import Strategy
from .fsdp import local_optimizer_params
from .offload import host_optimizer_params
from .terms import Term, TimeContext

#: Optimizer state bytes per parameter (brief convention): fp32 master + m + v, or bf16 m + v.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 12, "adamw_bf16": 4}


def optimizer_step_traffic(optimizer: str, dtype_bytes: int) -> int:
    """Bytes an AdamW step reads and writes per parameter (it is memory-bound).

    ``adamw``: read and write master, m, v (2 x 12), read the gradient, write the low-precision
    weight. ``adamw_bf16``: read and write weight, m and v, read the gradient.
    """
    state = OPTIMIZER_STATE_BYTES[optimizer]
    if optimizer == "adamw":
        return 2 * state + 2 * dtype_bytes
    return 2 * state + 3 * dtype_bytes


class OptimizerStep(Strategy):
    name = "optimizer"

    def exposed(self, ctx: TimeContext) -> Iterator[Term]:
        if not ctx.training:
            return
        topology = ctx.topology
        hbm = topology.gpu.memory_bandwidth * ctx.compute.fractions["memory"]
        traffic = optimizer_step_traffic(ctx.train.optimizer, ctx.train.dtype_bytes)
        cpu_params = host_optimizer_params(ctx)
        gpu_params = max(0.0, local_optimizer_params(ctx.model, ctx.train, ctx.layout) - cpu_params)
        yield Term("optimizer", gpu_params * traffic / hbm)
        if cpu_params > 0:
            cores = topology.spec.node.host.cpu_cores / topology.gpus_per_node
            yield Term("optimizer", max(cpu_params * traffic / topology.host_memory_bandwidth_per_gpu,
                                        cpu_params / (ctx.stack.cpu_optimizer_params_per_s_per_core * cores)))


__all__ = ["OPTIMIZER_STATE_BYTES", "OptimizerStep", "optimizer_step_traffic"]
