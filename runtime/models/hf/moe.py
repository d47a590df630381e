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

Expert parallelism (``ep > 1``): :func:`apply_hf_expert_parallel` replaces each MoE block's experts module by
:class:`ExpertParallelHFExperts`, which keeps transformers' parameter names and per-expert math but holds
``num_experts / ep`` experts per rank and sends tokens to them (:mod:`sp_plan.runtime.expert_parallel`). The
router stays replicated, so every routing decision is the single process's. Only the families tested exactly
(:data:`EXPERT_PARALLEL_MODEL_TYPES`) are split; another MoE family is refused with the reason.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.expert_parallel import expert_parallel_forward, local_experts, shard_expert_parameters
from sp_plan.runtime.models.hf.model import hf_architecture, hf_decoder_layers


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


#: The stacked expert weights of transformers' MoE experts module (Qwen3MoeExperts, MixtralExperts):
#: ``gate_up_proj`` ``[experts, 2 x intermediate, hidden]`` and ``down_proj`` ``[experts, hidden, intermediate]``.
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
#: MoE families whose experts module is ``down(act(gate) * up)`` over those weights, with the router's top-k
#: (ids, scores) passed in: checked exactly against one process in tests/test_ep_runtime.py.
EXPERT_PARALLEL_MODEL_TYPES = frozenset({"qwen3_moe", "mixtral"})


class ExpertParallelHFExperts(nn.Module):
    """transformers' experts module (same parameter names, same math: ``down(act(gate) * up)`` per expert,
    weighted by the router's score) with its experts split over the ``ep`` group and tokens dispatched to them
    (:func:`sp_plan.runtime.expert_parallel.expert_parallel_forward`)."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        for name in EXPERT_WEIGHTS:
            setattr(self, name, getattr(experts, name))
        shard_expert_parameters(self, EXPERT_WEIGHTS, ep_mesh)
        self.ep_group = ep_mesh.get_group()

    def _expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(rows, local_experts(self.gate_up_proj)[index]).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, local_experts(self.down_proj)[index])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_forward(hidden_states, top_k_index, top_k_weights, self.num_experts,
                                       self.ep_group, self._expert)


def apply_hf_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every MoE block's experts over ``ep_mesh`` (the weights must be the same on every rank); returns
    the new experts modules, which FSDP2 shards over the expert data group before their blocks."""
    arch = hf_architecture(model)
    model_type = model.config.model_type
    if not arch.is_moe:
        raise RuntimeConfigError(f"{model_type} has no mixture-of-experts blocks, so there are no experts to split: "
                                 "re-plan with --ep 1")
    if model_type not in EXPERT_PARALLEL_MODEL_TYPES:
        raise RuntimeConfigError(f"{model_type}: expert parallelism is implemented for "
                                 f"{', '.join(sorted(EXPERT_PARALLEL_MODEL_TYPES))} only (its experts module is not "
                                 "checked against one process); re-plan with --ep 1")
    replaced = []
    for layer in hf_decoder_layers(model):
        block = getattr(layer, arch.mlp)
        experts = getattr(block, arch.experts, None)
        if experts is None:  # a dense layer (Qwen3-MoE's mlp_only_layers)
            continue
        missing = [name for name in EXPERT_WEIGHTS if not isinstance(getattr(experts, name, None), nn.Parameter)]
        if missing:
            raise RuntimeConfigError(f"{model_type}: the experts module {type(experts).__name__} has no "
                                     f"stacked {', '.join(missing)} weight, which expert parallelism splits; use a "
                                     "transformers release with 3-D expert weights (5.x), or re-plan with --ep 1")
        ep_experts = ExpertParallelHFExperts(experts, ep_mesh)
        setattr(block, arch.experts, ep_experts)
        replaced.append(ep_experts)
    return replaced
