"""Time and bytes of collectives for a group of ranks placed on a topology (alpha-beta model).

Conventions (shared with the runtime's byte counters): bytes are SENT per GPU. For a group of P
ranks and the size argument ``n``:

=================  ==============================  ============================================
collective         ``n`` is                        bytes sent per GPU
=================  ==============================  ============================================
all_to_all         the rank's whole buffer          (P-1)/P x n  (its own chunk stays)
all_reduce         the tensor                       2 (P-1)/P x n  (ring: reduce-scatter + all-gather)
all_gather         the FULL (gathered) tensor       (P-1)/P x n
reduce_scatter     the FULL (unreduced) tensor      (P-1)/P x n
send_recv          one message to the ring peer     n  (one ring step: every rank sends to the next)
=================  ==============================  ============================================

Time model. A group spans N nodes with k ranks on each (P = k N, see :class:`GroupSpan`); all groups
of a mesh dimension run at once, so each GPU only gets its share of shared links. Latency (alpha) is
paid once per algorithm step; bandwidth (beta) terms of the traffic that stays inside a node and of
the traffic that crosses the fabric proceed in parallel, so the slower one sets the time:

- all_to_all (pairwise exchange, NCCL's grouped send/recv): intra = (k-1)/P n at the node's
  all-to-all bandwidth, inter = (P-k)/P n at the GPU's fabric share (every GPU sends across at once);
  t = (k-1) a_intra + (P-k) a_fabric + max(intra / B_a2a, inter / B_fabric).
- all_reduce / all_gather / reduce_scatter (ring, node-ordered): every rank sends V bytes to its ring
  successor; k-1 of each node's k hops stay inside the node, one crosses. The group's node-crossing
  traffic (V per node) spreads over the NICs of its k GPUs (NCCL channels), so
  t = steps x a + max(V / B_ring, V / (k B_fabric)), steps = 2(P-1) for all-reduce, P-1 otherwise,
  with a = a_fabric when the ring leaves the node (each lock-step waits for the slowest hop). For
  all-reduce across nodes the latency is the smaller of the ring's and a double binary tree's
  (2 (ceil(log2 N) a_fabric + (k-1) a_intra)), as NCCL picks the tree for small messages.
- send_recv (one ring-attention step): t = a + max(n / B_ring, n / B_fabric_p2p) where the second
  term applies when the ring crosses nodes (one crossing flow per group and node).

Not modelled: NVLink SHARP / in-network reductions, PXN routing through a peer GPU's NIC, protocol
switches (LL/LL128/Simple) beyond what a calibrated alpha and bandwidth absorb, and contention
between collectives of different mesh dimensions that overlap in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .errors import CostModelError
from .topology.topology import GroupSpan

Collective = Literal["all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send_recv"]
COLLECTIVES: tuple[str, ...] = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """One collective on one group: seconds, bytes sent per GPU, and the part that crosses nodes."""

    collective: str
    time_s: float
    bytes_sent: float
    fabric_bytes: float


def bytes_sent(collective: str, nbytes: float, group_size: int) -> float:
    """Bytes one GPU sends for ``collective`` over ``group_size`` ranks (see the module table)."""
    p = group_size
    if p <= 1:
        return 0.0
    if collective == "send_recv":
        return nbytes
    if collective == "all_reduce":
        return 2.0 * (p - 1) / p * nbytes
    if collective in ("all_to_all", "all_gather", "reduce_scatter"):
        return (p - 1) / p * nbytes
    raise CostModelError(f"unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}")


def node_dedup_fabric_fraction(top_k: int, experts: int, nodes: int) -> float:
    """Share of a MoE dispatch's node-crossing bytes left when each token crosses to a remote node once,
    whatever number of its ``top_k`` experts that node holds (DeepEP's and Hybrid-EP's hierarchical kernels:
    RDMA to the node, NVLink fan-out inside it), against a pairwise all-to-all of the permuted rows.

    With routing balanced over ``experts`` spread evenly on ``nodes`` nodes (the top-k a uniform draw
    without replacement), a token reaches a given remote node with probability
    ``1 - C(E - E/N, k) / C(E, k)``; the pairwise exchange sends ``k (N-1) / N`` copies across. Why: this
    is what makes an EP group that spans nodes 2-4x cheaper under DeepEP/Hybrid-EP than under NCCL's
    all-to-all. 1.0 for top-1 or one node; never above 1, falls as top_k grows."""
    top_k = min(top_k, experts)
    if nodes <= 1 or top_k <= 1:
        return 1.0
    remote_per_node = experts / nodes
    miss = 1.0
    for i in range(top_k):  # C(E - m, k) / C(E, k) as a product, m = experts on one node
        miss *= max(0.0, experts - remote_per_node - i) / (experts - i)
    reached = (nodes - 1) * (1.0 - miss)
    return min(1.0, reached / (top_k * (nodes - 1) / nodes))


def collective_cost(collective: str, nbytes: float, span: GroupSpan, fabric_fraction: float = 1.0) -> CollectiveCost:
    """Time and bytes of ``collective`` with size argument ``nbytes`` on the groups ``span`` describes
    (``fabric_fraction``: the all-to-all's node-crossing bytes a deduplicating dispatcher still sends)."""
    p, k, nodes = span.size, span.ranks_per_node, span.nodes
    sent = bytes_sent(collective, nbytes, p)
    if p <= 1 or nbytes <= 0:
        return CollectiveCost(collective, 0.0, 0.0, 0.0)
    if collective == "all_to_all":
        intra = (k - 1) / p * nbytes
        inter = (p - k) / p * nbytes * fabric_fraction if nodes > 1 else 0.0
        t = (k - 1) * span.alpha_intra + (p - k) * span.alpha_fabric * (nodes > 1)
        t += max(_over(intra, span.a2a_bandwidth), _over(inter, span.fabric_bandwidth))
        return CollectiveCost(collective, t, sent, inter)
    if collective == "send_recv":
        if nodes > 1:
            t = span.alpha_fabric + max(_over(nbytes, span.ring_bandwidth) if k > 1 else 0.0,
                                        _over(nbytes, span.fabric_p2p_bandwidth))
            # one of each group's k ranks per node sends across the fabric
            return CollectiveCost(collective, t, sent, nbytes / k)
        return CollectiveCost(collective, span.alpha_intra + _over(nbytes, span.ring_bandwidth), sent, 0.0)
    # ring collectives
    steps = 2 * (p - 1) if collective == "all_reduce" else p - 1
    intra_time = _over(sent, span.ring_bandwidth) if k > 1 else 0.0
    if nodes > 1:
        latency = steps * span.alpha_fabric
        if collective == "all_reduce":
            tree = 2 * (math.ceil(math.log2(nodes)) * span.alpha_fabric + (k - 1) * span.alpha_intra)
            latency = min(latency, tree)
        t = latency + max(intra_time, _over(sent, k * span.fabric_bandwidth))
        return CollectiveCost(collective, t, sent, sent / k)
    return CollectiveCost(collective, steps * span.alpha_intra + intra_time, sent, 0.0)


def _over(nbytes: float, bandwidth: float) -> float:
    if nbytes <= 0:
        return 0.0
    if bandwidth <= 0:
        raise CostModelError("a link with zero bandwidth cannot carry traffic; check the topology's calibration")
    return nbytes / bandwidth  # bandwidth may be inf -> 0.0
