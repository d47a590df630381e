"""Where each Hugging Face family keeps the modules the runtime works on: one table entry per ``model_type``.

The attention swap (:mod:`.attention`), the tiled MLP (:mod:`.techniques`), tensor parallelism
(:mod:`.tp_plan`, and the state-dict rules of :meth:`sp_plan.runtime.tp.TensorParallel.local_slice`) and
the model-part split all take module names from here, never spelled out in their code (picotron's
table, torchtitan's per-family plan): a new HF family whose decoder layer has the usual shape is one
:data:`HF_ARCHITECTURES` entry.

Torch-free (plain names), so the adapter can ask which families exist without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Megatron's split of a projection: ``column`` keeps output rows (bias split with them), ``row`` keeps
#: input columns (output summed over TP).
Style = Literal["column", "row"]
#: What a projection is cut along: query heads, KV heads, or FFN features.
Split = Literal["q", "kv", "ffn"]


@dataclass(frozen=True)
class HFArchitecture:
    """Module names of one HF family. Block entries are attribute names inside a decoder layer (the
    projections inside its attention / MLP child); the others are dotted paths from the causal LM."""

    #: The decoder layer's attention child (its forward calls the registered attention function).
    attention: str = "self_attn"
    #: Query, key, value and output projections inside :attr:`attention`.
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    #: Per-head norms inside :attr:`attention` (Qwen3's q/k norms); absent ones are skipped.
    head_norms: tuple[str, ...] = ("q_norm", "k_norm")
    #: The decoder layer's MLP child, and the gated MLP's projections and activation inside it.
    mlp: str = "mlp"
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    activation: str = "act_fn"
    #: Mixture-of-experts families: the MoE block's child holding the experts (blocks whose MLP has it
    #: are sparse; the others, e.g. Qwen3-MoE's ``mlp_only_layers``, are dense gated MLPs).
    experts: str | None = None
    #: Config attribute that adds the router's load-balancing loss to the model's output (MoE only).
    router_logits_option: str | None = None
    #: Multi-head latent attention (DeepSeek-V2/V3): q from a low-rank ``q_a``/``q_b`` pair, k and v expanded
    #: per head from one shared latent (``kv_a_proj_with_mqa`` -> ``kv_b_proj``) before attention, and a v head
    #: dim that differs from q/k's. The expanded heads go through the runtime's attention like MHA's (Ulysses
    #: splits all ``num_attention_heads``); the q/k/v projections above do not exist, so TP has no cut for it.
    latent_attention: bool = False
    #: The decoder layer's pre-norms (replicated under TP's sequence parallelism).
    block_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    layers: str = "model.layers"
    embedding: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    def tensor_parallel_projections(self) -> tuple[tuple[str, str, Style, Split], ...]:
        """``(submodule, projection, style, split)`` of every projection TP cuts: column-parallel q/k/v and
        gate/up, row-parallel o and down (Megatron's split). A MoE family's experts are not in it."""
        attention: tuple[tuple[str, str, Style, Split], ...] = (
            (self.attention, self.q_proj, "column", "q"),
            (self.attention, self.k_proj, "column", "kv"),
            (self.attention, self.v_proj, "column", "kv"),
            (self.attention, self.o_proj, "row", "q"),
        )
        if self.is_moe:
            return attention
        return attention + (
            (self.mlp, self.gate_proj, "column", "ffn"),
            (self.mlp, self.up_proj, "column", "ffn"),
            (self.mlp, self.down_proj, "row", "ffn"),
        )


#: Llama and the families that copy its decoder layer (Mistral, Qwen2 with QKV biases, Qwen3 with q/k norms).
LLAMA_LIKE = HFArchitecture()
#: Qwen3-MoE and Mixtral: a Llama-like attention, and a sparse MoE block (router ``gate`` + ``experts``) as MLP.
MOE_LIKE = HFArchitecture(experts="experts", router_logits_option="output_router_logits")

#: DeepSeek-V2/V3: MLA attention, and from layer ``first_k_dense_replace`` on a MoE block (router ``gate``,
#: routed ``experts``, ``shared_experts``); the first layers keep a dense gated MLP.
DEEPSEEK_LIKE = HFArchitecture(head_norms=(), experts="experts", router_logits_option="output_router_logits",
                               latent_attention=True)

#: The table: HF ``model_type`` -> where its modules are. The runtime drives exactly these families.
HF_ARCHITECTURES: dict[str, HFArchitecture] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,
    "qwen3_moe": MOE_LIKE,
    "mixtral": MOE_LIKE,
    "deepseek_v2": DEEPSEEK_LIKE,
    "deepseek_v3": DEEPSEEK_LIKE,
}
