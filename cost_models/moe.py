"""Mixture-of-experts FFNs and multi-head latent attention (MLA) as parts of a :class:`ModelSpec`.

Both are optional nested models of ``ModelSpec`` (``moe`` and ``mla``); a dense model leaves them
``None`` and every cost term keeps its dense formula. This module holds their shapes, their parameter
counts and their Hugging Face ``config.json`` reading (Qwen3-MoE, Mixtral, DeepSeek-V2/V3), so the
model spec only calls :func:`hf_moe_fields` and the cost terms ask the spec objects for sizes.

Conventions the cost terms rely on:

- **Experts are SwiGLU** (gate, up, down; no biases), as in all supported families.
- **Routed rows.** A MoE layer sends each token to ``top_k`` experts. Dropless routing (``capacity_factor``
  ``None``: HF, torchtitan, Megatron's dropless mode) computes exactly ``tokens x top_k`` expert rows;
  with a capacity factor every expert is padded (or cut) to ``ceil(capacity_factor x tokens x top_k /
  experts)`` rows, so ``experts`` x that is computed whatever the routing.
- **Load imbalance.** Routing is never perfectly even: ``load_imbalance`` is the busiest expert's load
  over the mean (default 1.15; auxiliary-loss-balanced models such as Mixtral, Qwen3-MoE and DeepSeek-V3
  report max/mean expert loads of roughly 1.1-1.3 over a batch). Dropless grouped GEMMs then run at
  uneven shapes: :meth:`MoESpec.expert_row_groups` splits the experts into a busy half at
  ``load_imbalance`` x the mean and a light half at ``2 - load_imbalance`` x the mean (same total rows):
  with every expert on the GPU that only reshapes one grouped GEMM (tile padding), it adds no work. An
  expert-parallel degree, when the layout gains one, makes the busiest rank the critical path (its rows
  are ``load_imbalance`` x the mean): :meth:`MoESpec.expert_row_groups` takes ``ep`` already, and the
  expert weights (:meth:`MoESpec.layer_params_tp`) and dispatch bytes divide by it.
- **MLA** (DeepSeek-V2/V3): queries through a low-rank latent (``q_lora_rank``; none for V2-Lite), keys
  and values from one shared latent of ``kv_lora_rank`` plus a decoupled RoPE key of ``qk_rope_head_dim``
  shared by all heads. In training the latent is up-projected to ``num_heads`` full keys and values
  (query/key head dim ``qk_nope + qk_rope``, value head dim ``v_head_dim``), so attention sees ordinary
  multi-head attention: ``ModelSpec.num_kv_heads = num_heads`` and ``head_dim = qk_head_dim``, and Ulysses
  splits those ``num_heads`` heads (the latent itself is per token, not per head).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .config_fields import whole_number
from .errors import CostModelError, explain_validation_error

if TYPE_CHECKING:  # the spec holds these parts; only the type is needed here
    from .model_spec import ModelSpec

#: Busiest expert's load over the mean expert load, when the model file gives none (see the module doc).
DEFAULT_LOAD_IMBALANCE = 1.15

#: Bytes per element of the router's logits/probabilities (routers run their softmax in fp32) and of the
#: top-k expert indices (torch.topk returns int64).
ROUTER_LOGIT_BYTES = 4
TOPK_INDEX_BYTES = 8


class MoESpec(BaseModel):
    """The mixture-of-experts FFN of a model's sparse layers (SwiGLU experts, a linear router)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_experts: int = Field(ge=1, le=1 << 16, description="routed experts per MoE layer")
    top_k: int = Field(ge=1, le=1 << 10, description="routed experts each token goes to")
    expert_ffn_hidden_size: int = Field(ge=1, le=1 << 22)
    num_shared_experts: int = Field(default=0, ge=0, le=1 << 10, description="experts every token goes to")
    #: Width of one shared expert's FFN; ``None``: the routed experts' width (DeepSeek).
    shared_expert_ffn_hidden_size: int | None = Field(default=None, ge=1, le=1 << 22)
    #: ``None``: dropless routing; otherwise each expert takes at most this multiple of its mean load.
    capacity_factor: float | None = Field(default=None, ge=1.0, le=64.0)
    load_imbalance: float = Field(default=DEFAULT_LOAD_IMBALANCE, ge=1.0, le=2.0)
    #: Layers (0-based) whose FFN is dense (``ModelSpec.ffn_hidden_size``) rather than MoE: DeepSeek's
    #: ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``, resolved.
    dense_layers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; a token cannot go to "
                             "more experts than there are")
        if len(set(self.dense_layers)) != len(self.dense_layers) or any(i < 0 for i in self.dense_layers):
            raise ValueError("dense_layers must list distinct non-negative layer indices")
        return self

    # ----- parameters ------------------------------------------------------------------------------
    @property
    def shared_width(self) -> int:
        """FFN width of all shared experts together (they run as one SwiGLU on every token)."""
        return self.num_shared_experts * (self.shared_expert_ffn_hidden_size or self.expert_ffn_hidden_size)

    def expert_params(self, hidden: int) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * hidden * self.expert_ffn_hidden_size

    def shared_params(self, hidden: int) -> int:
        return 3 * hidden * self.shared_width

    def router_params(self, hidden: int) -> int:
        return hidden * self.num_experts

    def layer_params(self, hidden: int) -> int:
        """Every parameter of one MoE FFN (all experts, shared experts, router)."""
        return self.num_experts * self.expert_params(hidden) + self.shared_params(hidden) + self.router_params(hidden)

    def active_layer_params(self, hidden: int) -> int:
        """Parameters one token multiplies by in a MoE FFN: its top-k experts, the shared ones, the router."""
        return self.top_k * self.expert_params(hidden) + self.shared_params(hidden) + self.router_params(hidden)

    def moe_layer_count(self, num_layers: int) -> int:
        """MoE layers among layers ``0 .. num_layers - 1``: a pipeline stage's model copy (fewer layers, the same
        ``dense_layers``) counts as the model's first layers, never as a negative count."""
        return num_layers - sum(1 for i in self.dense_layers if i < num_layers)

    def layer_params_tp(self, hidden: int, tp: int, ep: int = 1) -> float:
        """One MoE FFN per TP rank: every expert's (and the shared experts') FFN width split over ``tp``
        (expert tensor parallelism = tp, Megatron's default); the router replicated. ``ep`` ranks share the
        routed experts (``num_experts / ep`` each); today's layouts have no expert-parallel degree (1)."""
        routed = self.num_experts / ep * 3 * hidden * math.ceil(self.expert_ffn_hidden_size / tp)
        if ep == 1:
            routed = int(routed)
        return routed + 3 * hidden * math.ceil(self.shared_width / tp) + self.router_params(hidden)

    def dispatch_bytes(self, tokens: float, hidden: int, dtype_bytes: int, ep: int) -> float:
        """Bytes one rank sends in one dispatch (or combine) all-to-all over ``ep`` ranks: its routed rows
        of ``hidden`` elements, of which ``(ep - 1) / ep`` leave the rank (DESIGN.md's all-to-all rule).
        0 without expert parallelism: every expert is local and the permutation is a local copy."""
        return self.routed_rows(tokens) * hidden * dtype_bytes * (ep - 1) / ep

    # ----- routed tokens ---------------------------------------------------------------------------
    def expert_capacity(self, tokens: float) -> float:
        """Rows each expert computes with a capacity factor (padded or cut to it)."""
        if self.capacity_factor is None:
            raise CostModelError("expert_capacity needs a capacity factor; dropless routing has none")
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def routed_rows(self, tokens: float) -> float:
        """Expert rows computed for ``tokens`` tokens: the real count dropless, padded to capacity otherwise."""
        if self.capacity_factor is None:
            return tokens * self.top_k
        return self.num_experts * self.expert_capacity(tokens)

    def rank_routed_rows(self, tokens: float, ep: int = 1) -> float:
        """Expert rows the busiest of ``ep`` ranks computes when each holds ``tokens`` tokens: the dispatch
        all-to-all gathers the rows of its ``num_experts / ep`` experts from all ``ep`` ranks. Dropless, the
        mean rank gets ``tokens x top_k`` rows and the busiest ``load_imbalance`` times that; with a capacity
        factor every local expert runs at its capacity for the ``ep x tokens`` tokens. ``ep = 1``: this
        rank's own :meth:`routed_rows` (the imbalance only reshapes the grouped GEMM)."""
        if ep == 1:
            return self.routed_rows(tokens)
        if self.capacity_factor is not None:
            return self.num_experts // ep * self.expert_capacity(tokens * ep)
        return tokens * self.top_k * self.load_imbalance

    def expert_row_groups(self, tokens: float, ep: int = 1) -> list[tuple[float, float]]:
        """``(rows per expert, experts)`` groups one rank's grouped GEMM runs for ``tokens`` tokens.

        ``ep`` ranks share the experts (``num_experts / ep`` each) and, through the dispatch all-to-all,
        the tokens of all ``ep`` ranks; ``ep = 1`` (today's layouts) keeps every expert local. Capacity
        routing runs every expert at its capacity; dropless routing runs a busy half of the experts at
        ``load_imbalance`` x the mean load and the other half at ``2 - load_imbalance`` x it (same total).
        With ``ep > 1`` the busiest rank holds the busy experts: its whole share at ``load_imbalance`` x.
        """
        local = self.num_experts / ep
        if self.capacity_factor is not None:
            return [(float(self.expert_capacity(tokens * ep)), local)]
        mean = tokens * ep * self.top_k / self.num_experts
        if ep > 1:
            return [(mean * self.load_imbalance, local)]
        busy = math.ceil(local / 2)
        groups = [(mean * self.load_imbalance, float(busy))]
        if local - busy:
            groups.append((mean * (2 - self.load_imbalance), float(local - busy)))
        return groups


class MLASpec(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``None``: queries come from a full ``hidden x heads x qk_head_dim`` projection (DeepSeek-V2-Lite).
    q_lora_rank: int | None = Field(default=None, ge=1, le=1 << 20)
    kv_lora_rank: int = Field(ge=1, le=1 << 20)
    qk_nope_head_dim: int = Field(ge=0, le=1 << 14)
    qk_rope_head_dim: int = Field(ge=1, le=1 << 14)
    v_head_dim: int = Field(ge=1, le=1 << 14)

    @property
    def qk_head_dim(self) -> int:
        """Query and key head dim attention multiplies over (content part + decoupled RoPE part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_width(self) -> int:
        """Per-token output of the KV down-projection: the latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def q_params(self, hidden: int, heads: int, tp: int = 1) -> float:
        """Query projections one TP rank holds: the down-projection and its norm replicated (Megatron's
        MLA keeps the latent projections whole), the up-projection split by heads."""
        if self.q_lora_rank is None:
            return hidden * heads * self.qk_head_dim / tp
        return hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim / tp

    def kv_params(self, hidden: int, heads: int, tp: int = 1) -> float:
        """KV down-projection (with the RoPE key) and its latent norm (replicated), and the up-projection to
        K content and V (split by heads over ``tp``)."""
        return (hidden * self.kv_latent_width + self.kv_lora_rank
                + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim) / tp)

    def params(self, hidden: int, heads: int, tp: int = 1) -> float:
        """Attention parameters of one layer per TP rank (query, key/value, output projection, latent norms);
        a whole number at ``tp = 1``."""
        total = self.q_params(hidden, heads, tp) + self.kv_params(hidden, heads, tp) + heads * self.v_head_dim * hidden / tp
        return int(total) if tp == 1 else total

    def projection_gemms(self, hidden: int, heads: int) -> list[tuple[int, int]]:
        """``(out, in)`` widths of the projection matmuls in forward order (q_a, q_b | q, kv_a, kv_b, o)."""
        q = ([(self.q_lora_rank, hidden), (heads * self.qk_head_dim, self.q_lora_rank)] if self.q_lora_rank
             else [(heads * self.qk_head_dim, hidden)])
        return q + [(self.kv_latent_width, hidden), (heads * (self.qk_nope_head_dim + self.v_head_dim),
                                                     self.kv_lora_rank), (hidden, heads * self.v_head_dim)]


def layers_params_tp(model: ModelSpec, tp: int, gqa_attention: float, dense_mlp: float, ep: int = 1) -> float:
    """Parameters of all transformer layers together per TP rank (and EP rank: ``num_experts / ep`` routed
    experts per MoE layer), norms excluded.

    ``gqa_attention`` and ``dense_mlp`` are the caller's per-rank counts of ordinary attention and of one
    dense FFN; MLA replaces the former, and each MoE layer's FFN replaces the latter. Weights, gradients,
    optimizer states and FSDP traffic are linear in the sum; a cost term that works block by block uses
    the mean block (:func:`mean_layer_params_tp`; DeepSeek-V3's 3 dense layers put it 5% below a MoE block).
    """
    attention = model.mla.params(model.hidden_size, model.num_heads, tp) if model.mla is not None else gqa_attention
    total = model.num_layers * attention
    if model.moe is None:
        return total + model.num_layers * dense_mlp
    sparse = model.moe_layer_count
    return total + (model.num_layers - sparse) * dense_mlp + sparse * model.moe.layer_params_tp(model.hidden_size, tp, ep)


def expert_layer_params(model: ModelSpec, tp: int, ep: int, when_ep: int) -> float:
    """Routed-expert parameters of the mean layer per TP rank, split over ``ep``, when ``when_ep`` > 1 (the
    layout's expert-parallel degree; 0 otherwise): what data parallelism's traffic moves over the expert
    data-parallel group instead of the shard group."""
    return routed_expert_params_tp(model, tp, ep) / model.num_layers if when_ep > 1 else 0.0


def routed_expert_params_tp(model: ModelSpec, tp: int, ep: int = 1) -> float:
    """Routed-expert parameters of all MoE layers per TP and EP rank: the part of :func:`layers_params_tp`
    that ZeRO/FSDP shards over the expert data-parallel ranks (shard group / ep) instead of the shard group."""
    if model.moe is None:
        return 0
    moe = model.moe
    return model.moe_layer_count * moe.num_experts / ep * 3 * model.hidden_size * math.ceil(moe.expert_ffn_hidden_size / tp)


def mean_layer_params_tp(model: ModelSpec, tp: int, gqa_attention: float, dense_mlp: float) -> float:
    """:func:`layers_params_tp` per layer: the mean transformer layer per TP rank, norms excluded."""
    return layers_params_tp(model, tp, gqa_attention, dense_mlp) / model.num_layers


# ----- Hugging Face config.json --------------------------------------------------------------------

def _int(config: Mapping, key: str, name: str, default: int | None = None, lo: int = 1, hi: int = 1 << 22) -> int:
    return whole_number(config, key, name, lo, hi, default)


def _layer_list(config: Mapping, key: str, name: str, num_layers: int) -> tuple[int, ...]:
    value = config.get(key) or []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise CostModelError(f"{name}: config.json field {key!r} must be a list of layer indices, not {value!r}")
    bad = [i for i in value if not 0 <= i < num_layers]
    if bad:
        raise CostModelError(f"{name}: config.json field {key!r} names layers {bad} outside 0..{num_layers - 1}")
    return tuple(sorted(set(value)))


def _qwen3_moe(config: Mapping, name: str, num_layers: int) -> dict:
    step = _int(config, "decoder_sparse_step", name, default=1, hi=num_layers)
    only_dense = set(_layer_list(config, "mlp_only_layers", name, num_layers))
    dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
    moe = MoESpec(num_experts=_int(config, "num_experts", name, hi=1 << 16),
                  top_k=_int(config, "num_experts_per_tok", name, hi=1 << 10),
                  expert_ffn_hidden_size=_int(config, "moe_intermediate_size", name),
                  dense_layers=dense)
    return {"moe": moe}


def _mixtral(config: Mapping, name: str, num_layers: int) -> dict:
    moe = MoESpec(num_experts=_int(config, "num_local_experts", name, hi=1 << 16),
                  top_k=_int(config, "num_experts_per_tok", name, hi=1 << 10),
                  expert_ffn_hidden_size=_int(config, "intermediate_size", name))
    return {"moe": moe}


def _deepseek(config: Mapping, name: str, num_layers: int) -> dict:
    first_dense = _int(config, "first_k_dense_replace", name, default=0, lo=0, hi=num_layers)
    freq = _int(config, "moe_layer_freq", name, default=1, hi=num_layers)
    dense = tuple(i for i in range(num_layers) if i < first_dense or i % freq)
    experts = config.get("n_routed_experts")
    moe = None
    if experts:  # a DeepSeek config without routed experts is a dense MLA model
        moe = MoESpec(num_experts=_int(config, "n_routed_experts", name, hi=1 << 16),
                      top_k=_int(config, "num_experts_per_tok", name, hi=1 << 10),
                      expert_ffn_hidden_size=_int(config, "moe_intermediate_size", name),
                      num_shared_experts=_int(config, "n_shared_experts", name, default=0, lo=0, hi=1 << 10),
                      dense_layers=dense)
    q_rank = config.get("q_lora_rank")
    mla = MLASpec(q_lora_rank=None if q_rank is None else _int(config, "q_lora_rank", name, hi=1 << 20),
                  kv_lora_rank=_int(config, "kv_lora_rank", name, hi=1 << 20),
                  qk_nope_head_dim=_int(config, "qk_nope_head_dim", name, lo=0, hi=1 << 14),
                  qk_rope_head_dim=_int(config, "qk_rope_head_dim", name, hi=1 << 14),
                  v_head_dim=_int(config, "v_head_dim", name, hi=1 << 14))
    heads = _int(config, "num_attention_heads", name, hi=1 << 14)
    # Training up-projects the latent to every head: attention is multi-head at the query/key head dim.
    return {"moe": moe, "mla": mla, "num_kv_heads": heads, "head_dim": mla.qk_head_dim}


#: model_type -> the reader of its MoE/MLA fields (model_spec's ``_HF_FAMILIES`` lists the same types).
_READERS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek}


def hf_moe_fields(config: Mapping, model_type: str, name: str, num_layers: int) -> dict:
    """ModelSpec fields a MoE/MLA config.json adds or overrides (``{}`` for a dense family).

    ``moe``/``mla`` specs, and for MLA the attention shape the kernels see (``num_kv_heads = heads``,
    ``head_dim = qk_nope + qk_rope``). A routing we do not model is refused with what to do instead.
    """
    reader = _READERS.get(model_type)
    if reader is None:
        return {}
    if model_type.startswith("deepseek") and str(config.get("topk_method", "greedy")) not in (
            "greedy", "group_limited_greedy", "noaux_tc"):
        raise CostModelError(f"{name}: topk_method {config.get('topk_method')!r} is not modelled; "
                             "use greedy, group_limited_greedy or noaux_tc")
    try:
        return reader(config, name, num_layers)
    except ValidationError as exc:
        raise explain_validation_error(exc, f"mixture-of-experts/MLA fields of model config {name}") from exc


__all__ = [
    "DEFAULT_LOAD_IMBALANCE",
    "ROUTER_LOGIT_BYTES",
    "TOPK_INDEX_BYTES",
    "MLASpec",
    "MoESpec",
    "hf_moe_fields",
    "layers_params_tp",
    "mean_layer_params_tp",
]
