"""What the runtime checks before training an HF mixture-of-experts model (Qwen3-MoE, Mixtral, DeepSeek-V2/V3).

Sequence parallelism keeps an MoE block exact: the router scores each token from that token's hidden
state alone and picks its top-k experts per token, so a rank holding a slice of the sequence routes its
tokens exactly as a single process routes the whole sequence, and FSDP2 shards the expert weights like
any other parameter (tests/test_hf_moe.py checks loss and gradients against one process). Two settings
are not per token, and are refused with the reason:

- ``output_router_logits``: the auxiliary load-balancing loss is a product of two means over ALL tokens
  (the fraction routed to each expert x the mean router probability). A rank sees ``1/sp`` of the
  tokens, so its means, and the loss, differ from the single-process value unless the router
  statistics are all-reduced over the sequence-parallel group with their gradients; the runtime does
  not do that, and its token-weighted cross-entropy does not add the model's ``aux_loss`` either (it
  would be dropped silently);
- ``router_jitter_noise`` (Mixtral): random multiplicative noise on the router input in training, drawn
  independently per rank, so routing would no longer match a single process.
"""

from __future__ import annotations

from torch import nn

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.hf.model import hf_architecture


def check_moe_training(model: nn.Module) -> None:
    """Refuse the MoE settings the runtime cannot train exactly (a no-op for dense families)."""
    arch = hf_architecture(model)
    if not arch.is_moe:
        return
    config = model.config
    if arch.router_logits_option and getattr(config, arch.router_logits_option, False):
        raise RuntimeConfigError(
            f"{config.model_type}: {arch.router_logits_option}=True asks for the router's load-balancing loss, "
            "which averages expert load over all tokens; each sequence-parallel rank sees only its shard, and the "
            f"runtime's loss does not add it: set config.{arch.router_logits_option} = False"
        )
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        raise RuntimeConfigError(
            f"{config.model_type}: router_jitter_noise={jitter} draws random noise per rank, so tokens would be "
            "routed differently than in one process: set config.router_jitter_noise = 0"
        )
