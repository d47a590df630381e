"""The ops of a mixture-of-experts FFN on one GPU, for the block graph (:mod:`.block`).

It mirrors the dropless token-choice MoE of HF Qwen3-MoE/Mixtral/DeepSeek and of torchtitan, whose
autograd saves per op what :mod:`.block` describes for dense layers:

    x -> router linear (saves x) -> softmax in fp32 (saves its output) -> top-k (weights fp32, int64 indices)
      -> dispatch: gather the routed rows (saves the indices) -> grouped gate/up (save the routed rows)
      -> SiLU x up (saves both) -> grouped down (saves the product) -> weight by the top-k probabilities
      (saves the expert outputs and the weights) -> combine: scatter-add back to the tokens
    x -> shared experts' SwiGLU (a dense MLP of the shared width), added to the routed output

Routed rows are ``MoESpec.routed_rows(tokens)``: ``tokens x top_k`` dropless, every expert padded to its
capacity with a capacity factor. With expert parallelism (``ep > 1``) a dispatch all-to-all brings the rows
of this rank's ``num_experts / ep`` experts from all ep ranks (the busiest rank's ``load_imbalance`` x the
mean, :meth:`MoESpec.rank_routed_rows`), the experts run on those, and a combine all-to-all returns this
rank's ``tokens x top_k`` rows before the weighting. Expert widths are split over tp like a dense FFN (expert tensor
parallelism = tp). The block graph is one block for every layer: a model with dense layers too
(DeepSeek-V3's first 3) is costed with its MoE block, the larger one of the two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..moe import ROUTER_LOGIT_BYTES, TOPK_INDEX_BYTES
from .dims import ceil_div
from .graph import MATMUL, TensorSpec

if TYPE_CHECKING:
    from .block import BlockBuilder

#: ``_mlp_ops(builder, x, saved_in, regather, tokens, holds=..., width=..., prefix=...)``: block.py's dense MLP.
DenseMlp = Callable[..., str]


def routed_rows(b: BlockBuilder, tokens: int) -> int:
    """Expert rows this GPU computes for ``tokens`` tokens (dropless: tokens x top_k; capacity: padded)."""
    return int(b.m.moe.routed_rows(tokens))


def moe_ffn_ops(b: BlockBuilder, x: str, saved_in: str, regather: int, tokens: int, holds: tuple[str, ...],
                dense_mlp: DenseMlp) -> str:
    """The MoE FFN's ops on ``tokens`` tokens; returns the name of its output (tokens x hidden)."""
    moe, d, B = b.m.moe, b.d, b.B
    experts, k = moe.num_experts, moe.top_k
    logits = TensorSpec("router", tokens * experts * B)
    b.g.op("router", [x], [logits], saves=[saved_in], tags=(MATMUL,))
    probs = b.simple("router.softmax", ["router"], tokens * experts * ROUTER_LOGIT_BYTES, saves=["router.softmax"])
    weights = TensorSpec("router.topk", tokens * k * ROUTER_LOGIT_BYTES)
    indices = TensorSpec("router.topk_indices", tokens * k * TOPK_INDEX_BYTES, requires_grad=False)
    b.g.op("router.topk", [probs], [weights, indices], saves=[indices.name])
    rows = routed_rows(b, tokens)
    dispatched = b.simple("moe.dispatch", [x, indices.name], rows * d.hidden * B, saves=[indices.name])
    expert_rows = rows
    if d.ep > 1:  # the dispatch all-to-all: the rows of this rank's experts, from all ep ranks (busiest rank)
        expert_rows = int(moe.rank_routed_rows(tokens, d.ep))
        dispatched = b.simple("moe.dispatch_all_to_all", [dispatched], expert_rows * d.hidden * B)
    expert_out = dense_mlp(b, dispatched, dispatched, 0, expert_rows,
                           width=ceil_div(moe.expert_ffn_hidden_size, d.tp), prefix="experts.")
    if d.ep > 1:  # the combine all-to-all: this rank's tokens' expert outputs come back
        expert_out = b.simple("moe.combine_all_to_all", [expert_out], rows * d.hidden * B)
    weighted = b.simple("moe.weighted", [expert_out, weights.name], rows * d.hidden * B,
                        saves=[expert_out, weights.name])
    out = b.simple("moe.combine", [weighted, indices.name], tokens * d.hidden * B, saves=[indices.name])
    if moe.shared_width:
        shared = dense_mlp(b, x, saved_in, regather, tokens, width=ceil_div(moe.shared_width, d.tp),
                           prefix="shared_experts.")
        out = b.simple("moe.add_shared", [out, shared], tokens * d.hidden * B)
    # The FFN module's input stays referenced until it returns (as for a dense MLP).
    return b.simple("moe.out", [out], tokens * d.hidden * B, passthrough=True, holds=holds)
