"""The query/key/value projections of multi-head latent attention (DeepSeek-V2/V3) for the block graph.

Mirrors HF's DeepseekV3Attention in training (the latent is up-projected per head, no absorbed weights):

    x -> q_a_proj (saves x) -> q_a_layernorm -> q_b_proj (saves the normed latent) -> q [heads x qk_head_dim]
      -> RoPE on the q_pe part (qk_rope_head_dim per head) -> cat(q_nope, q_pe) -> q
    x -> kv_a_proj_with_mqa (saves x) -> [latent kv_lora_rank | k_pe qk_rope_head_dim]
      -> kv_a_layernorm(latent) -> kv_b_proj (saves the normed latent) -> [k_nope | v] per head
      -> RoPE on the one shared k_pe -> k = cat(k_nope, k_pe expanded to every head)
      -> v padded to qk_head_dim (flash_attention_2 needs one head dim; the output is sliced back after)

So the attention op downstream sees ordinary multi-head q, k, v of ``head_dim = qk_head_dim``
(``ModelSpec.num_kv_heads = num_heads``), exactly the sizes :class:`~.dims.LocalDims` gives; what MLA
adds are the latent activations (q_a, kv_a and their normed copies) and the RoPE and concatenation copies.
The latent projections are replicated over tp; the up-projections are split by heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block import BlockBuilder


def mla_projections(b: BlockBuilder, x: str, saved_in: str, regather: int) -> tuple[str, str, str]:
    """Ops from the (gathered) normed input ``x`` to q, k and v as the attention call takes them."""
    mla, d, B = b.m.mla, b.d, b.B
    t = d.tokens
    if mla.q_lora_rank:
        q_latent = b.linear("q_a_proj", x, t * mla.q_lora_rank * B, saved_in, regather)
        q_latent = b.norm("q_a_layernorm", q_latent, t, mla.q_lora_rank)
        q = b.linear("q_b_proj", q_latent, d.q_bytes())
    else:
        q = b.linear("q_proj", x, d.q_bytes(), saved_in, regather)
    q_pe = b.rope("q_rope", q, t * d.q_heads * mla.qk_rope_head_dim * B)
    if q_pe != q:
        q = b.simple("q_cat", [q, q_pe], d.q_bytes())
    kv_latent = b.linear("kv_a_proj_with_mqa", x, t * mla.kv_latent_width * B, saved_in, regather)
    k_pe = b.rope("k_rope", kv_latent, t * mla.qk_rope_head_dim * B)
    normed = b.norm("kv_a_layernorm", kv_latent, t, mla.kv_lora_rank)
    kv_heads = d.kv_heads_proj
    kv = b.linear("kv_b_proj", normed, t * kv_heads * (mla.qk_nope_head_dim + mla.v_head_dim) * B)
    k = b.simple("k_cat", [kv, k_pe], d.k_proj_bytes())
    v = b.simple("v_pad", [kv], d.k_proj_bytes()) if mla.v_head_dim != mla.qk_head_dim else kv
    return q, k, v
