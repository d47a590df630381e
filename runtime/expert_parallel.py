"""Expert parallelism (EP): each rank of the ``ep`` group holds ``num_experts / ep`` experts, and every
routed token travels to the rank holding its expert and back (torchtitan's token dispatch and combine).

The ``ep`` group is the one the planner prices (:func:`sp_plan.cost_models.placement.expert_group_shapes`): the
innermost ``ep`` ranks of the ZeRO/FSDP shard group, which hold different tokens (another data shard or another
slice of the sequence). The ranks holding the same experts (shard group / ep, the ``expert_data`` group) shard
the expert weights with FSDP2 (:attr:`sp_plan.runtime.mesh.RuntimeMesh.expert_mesh`).

One MoE layer's experts, given each token's top-k experts and weights from the (replicated) router:

1. **dispatch**: the ``tokens x top_k`` rows are sorted by expert (stably, so ties keep token order), the
   per-expert row counts are exchanged with one ``all_to_all_single``, and the rows with another (autograd
   aware: its backward sends the gradients back the same way); the received rows, ordered by source rank then
   local expert, are regrouped by local expert;
2. the local experts run on their rows (the caller's function, one expert at a time);
3. **combine**: the outputs are put back in arrival order and sent home by the reverse all-to-all, weighted
   by the router's scores and summed per token in expert order (the order a single process adds them in).

Expert weights are DTensors sharded ``Shard(0)`` over the ``ep`` mesh (:func:`shard_expert_parameters`), so
their global shape and state-dict keys are those of the whole model (a DCP checkpoint saved under ``ep=2``
loads under ``ep=1``); FSDP2 then shards each rank's experts over the expert data group. Gradients: a
rank's expert gradient already sums the contributions of every token of its ``ep`` group (the all-to-all's
backward brings them), and FSDP2 sums it over the expert data group, as the dense weights are summed over
the data group with the global token-count loss (:mod:`sp_plan.runtime.loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor, Shard

from sp_plan.runtime.errors import RuntimeConfigError

#: Runs local expert ``e`` (0-based on this rank) on its rows: ``(e, rows) -> outputs`` of the same shape.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TokenRoutes:
    """Where one dispatch sent each row, so the combine can bring the outputs back in the same places."""

    #: Source row order: row ``i`` of the sorted rows is flattened ``(token, k)`` entry ``order[i]``.
    order: torch.Tensor
    #: Rows sent to / received from each rank of the ``ep`` group.
    send_counts: list[int]
    recv_counts: list[int]
    #: Arrival order -> local-expert order of the received rows.
    by_expert: torch.Tensor
    #: Received rows per local expert.
    rows_per_expert: list[int]


def _check_divides(num_experts: int, ep: int) -> int:
    if num_experts % ep:
        raise RuntimeConfigError(f"ep={ep} does not divide {num_experts} experts: each ep rank holds whole experts; "
                                 "use an ep that divides the expert count")
    return num_experts // ep


def _all_to_all(rows: torch.Tensor, recv_counts: list[int], send_counts: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """Rows to and from every rank of ``group`` (uneven splits); its backward sends the gradients back."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv_counts, send_counts, group))


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
             group: dist.ProcessGroup) -> tuple[torch.Tensor, TokenRoutes]:
    """Send each token's hidden state (``[tokens, hidden]``) to the ranks holding its top-k experts
    (``top_k_index``: ``[tokens, k]`` global expert ids); returns the received rows grouped by local expert,
    and the routes the combine needs."""
    ep = dist.get_world_size(group)
    local = _check_divides(num_experts, ep)
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    recv_matrix = torch.empty_like(counts)
    dist.all_to_all_single(recv_matrix, counts, group=group)  # rank r's counts for my experts
    recv_matrix = recv_matrix.view(ep, local)
    send_counts = counts.view(ep, local).sum(dim=1).tolist()
    recv_counts = recv_matrix.sum(dim=1).tolist()
    rows = hidden[order // top_k]
    received = _all_to_all(rows, recv_counts, send_counts, group)
    local_ids = torch.arange(local, device=counts.device).repeat(ep)
    arrival_expert = torch.repeat_interleave(local_ids, recv_matrix.reshape(-1))
    by_expert = torch.argsort(arrival_expert, stable=True)
    routes = TokenRoutes(order=order, send_counts=send_counts, recv_counts=recv_counts, by_expert=by_expert,
                         rows_per_expert=recv_matrix.sum(dim=0).tolist())
    return received[by_expert], routes


def run_local_experts(rows: torch.Tensor, routes: TokenRoutes, expert: ExpertFn) -> torch.Tensor:
    """Each local expert on its contiguous block of ``rows`` (as :func:`dispatch` grouped them)."""
    outputs = [expert(e, block) for e, block in enumerate(torch.split(rows, routes.rows_per_expert))]
    return torch.cat(outputs) if outputs else rows


def combine(outputs: torch.Tensor, routes: TokenRoutes, top_k_weights: torch.Tensor, num_tokens: int,
            group: dist.ProcessGroup) -> torch.Tensor:
    """Bring the expert ``outputs`` (grouped by local expert) home, weight them by the router scores
    (``[tokens, k]``) and sum each token's rows in expert order; returns ``[tokens, hidden]``."""
    arrival = outputs[torch.argsort(routes.by_expert)]
    back = _all_to_all(arrival, routes.send_counts, routes.recv_counts, group)
    top_k = top_k_weights.shape[1]
    weights = top_k_weights.reshape(-1)[routes.order]
    weighted = back * weights[:, None].to(back.dtype)
    out = torch.zeros(num_tokens, back.shape[1], dtype=back.dtype, device=back.device)
    return out.index_add(0, routes.order // top_k, weighted)


def expert_parallel_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                            num_experts: int, group: dist.ProcessGroup, expert: ExpertFn) -> torch.Tensor:
    """One MoE layer's experts under EP: :func:`dispatch`, :func:`run_local_experts`, :func:`combine`."""
    rows, routes = dispatch(hidden, top_k_index, num_experts, group)
    return combine(run_local_experts(rows, routes, expert), routes, top_k_weights, hidden.shape[0], group)


def shard_expert_parameters(module: nn.Module, names: Sequence[str], ep_mesh) -> None:
    """Replace ``module``'s stacked expert parameters (``[num_experts, ...]``, the same on every rank) by
    DTensors sharded ``Shard(0)`` over ``ep_mesh``: this rank keeps its ``num_experts / ep`` experts, and the
    parameter keeps the whole model's shape and name (for checkpoints and the optimizer)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in names:
        full = getattr(module, name)
        local = _check_divides(full.shape[0], ep)
        piece = full.detach()[rank * local:(rank + 1) * local].clone()
        sharded = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                     stride=full.stride())
        setattr(module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked expert weight (its local shard when it is a DTensor)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
