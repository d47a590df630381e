"""The output layer as a graph: final norm, lm_head, logits and cross-entropy.

HF's causal-LM loss (``ForCausalLMLoss``) is what most training scripts run::

    logits = lm_head(hidden)                  # bf16, tokens x vocab/tp (vocab-parallel under TP)
    logits = logits.float()                   # fp32 copy
    loss = cross_entropy(logits, labels)      # log_softmax (saves its fp32 output) + nll_loss

so forward holds bf16 + fp32 + log-softmax (10 B per logit in bf16) and backward, at the log-softmax
backward, holds the bf16 logits the caller keeps, the saved log-softmax output, its incoming gradient and
the gradient it produces: 14 B per logit. A tiled (fused) loss (the runtime's ``sp_plan.runtime.tiled_loss``)
runs the lm_head inside a loop over chunks of ``loss_chunk_tokens`` tokens, saving only the hidden
states and the per-token fp32 LSE and recomputing each chunk's logits in backward, so the logits never
exist for the whole sequence. Its working set per chunk, mirrored here: the chunk's logits in the
compute dtype while they are upcast to fp32, everything after in place in the fp32 buffer (forward:
``exp(x - max)`` and its sum; backward: the softmax and its gradient), and in backward the cast of the
gradient to the compute dtype (the fp32 buffer is freed after it) beside one chunk of hidden-state
gradient.

Prefill computes logits for the last token only unless ``prefill_logits_all_tokens``.
"""

from __future__ import annotations

from ..model_spec import ModelSpec
from .assumptions import MemoryAssumptions
from .block import FP32, BlockBuilder
from .dims import LocalDims
from .graph import Graph, TensorSpec, Workspace

#: Bytes of the scalar loss.
LOSS_BYTES = FP32


def output_graph(model: ModelSpec, d: LocalDims, a: MemoryAssumptions, *, training: bool, tiled_loss: bool) -> Graph:
    b = BlockBuilder(model, d, a, training, tiled_mlp=False, kernel="flash")
    B = d.compute_bytes
    y = b.g.input("last_block_out", d.norm_tokens * d.hidden * B)
    hidden = b.norm("final_norm", y, d.norm_tokens, d.hidden)
    hidden = b.tp_gather("final_norm", hidden, d.tokens * d.hidden * B)
    if not training:
        tokens = d.tokens if a.prefill_logits_all_tokens else d.batch
        logits = b.linear("lm_head", hidden, tokens * d.vocab * B, kind="logits")
        b.simple("logits_fp32", [logits], tokens * d.vocab * FP32, kind="logits")
        return b.g.build(outputs=("logits_fp32",))
    if tiled_loss and a.tiled_loss_implementation == "liger_flce":
        return _liger_flce(b, hidden, d)
    if tiled_loss:
        chunk_tokens = min(a.loss_chunk_tokens, d.tokens)
        chunk = chunk_tokens * d.vocab
        upcast = chunk * (B + FP32)  # chunk logits in the compute dtype and their fp32 copy
        fwd = [Workspace(upcast, "logits")]
        # backward: the same upcast, later the gradient's cast (compute dtype) next to one chunk of
        # hidden-state gradient; whichever moment is larger
        grad_hidden = chunk_tokens * d.hidden * B
        if chunk * B + grad_hidden > upcast:
            bwd = [Workspace(chunk * B, "logits"), Workspace(grad_hidden)]
        else:
            bwd = [Workspace(upcast, "logits")]
        lse = TensorSpec("tiled_loss.lse", d.tokens * FP32, requires_grad=False)
        b.g.op("tiled_loss", [hidden], [TensorSpec("tiled_loss", LOSS_BYTES), lse], saves=[hidden, lse.name],
               fwd_workspace=fwd, bwd_workspace=bwd)
        return b.g.build(outputs=("tiled_loss",))
    elems = d.tokens * d.vocab
    logits = b.linear("lm_head", hidden, elems * B, kind="logits")
    if a.cross_entropy_implementation == "te_fused":
        # TE parallel_cross_entropy: online-softmax statistics (m, d, x_y: 3 fp32 per token) and the per-token
        # fp32 loss; the compute-dtype logits are saved and the backward kernel overwrites them with the gradient.
        stats = TensorSpec("ce.stats", d.tokens * 3 * FP32, requires_grad=False)
        b.g.op("te_parallel_ce", [logits], [TensorSpec("loss", d.tokens * FP32), stats], saves=[logits, stats.name],
               grad_from_saved=logits)
        return b.g.build(outputs=("loss",))
    if a.cross_entropy_implementation == "megatron_fused":
        # fused_vocab_parallel_cross_entropy: calculate_logits_max's fp32 upcast is exponentiated and normalised in
        # place and saved; backward turns it into the gradient in place and casts that to the logits' dtype (a new
        # compute-dtype buffer while the fp32 one is still alive), so no grad_from_saved here.
        softmax = TensorSpec("ce.softmax", elems * FP32, kind="logits", requires_grad=False)
        b.g.op("fused_vocab_parallel_ce", [logits], [TensorSpec("loss", d.tokens * FP32), softmax],
               saves=[softmax.name])
        return b.g.build(outputs=("loss",))
    if B != FP32:
        logits32 = b.simple("logits_fp32", [logits], elems * FP32, kind="logits")
    else:
        logits32 = logits
    if a.cross_entropy_implementation == "megatron":
        # Megatron's _VocabParallelCrossEntropy on logits.float(): subtracts the max into a new fp32 tensor,
        # exponentiates and normalises it in place and saves it; backward turns it into the gradient in place.
        softmax = TensorSpec("ce.softmax", elems * FP32, kind="logits", requires_grad=False)
        b.g.op("vocab_parallel_ce", [logits32], [TensorSpec("loss", LOSS_BYTES), softmax], saves=[softmax.name],
               grad_from_saved=softmax.name, holds=(logits,))  # the caller still references the bf16 logits
        return b.g.build(outputs=("loss",))
    scores = logits32
    if a.hf_shift_logits_copy:
        # ForCausalLMLoss before labels were pre-shifted: logits[..., :-1, :].contiguous() (an fp32 copy); its
        # backward scatters the gradient into a zero-filled full-size tensor
        scores = b.simple("shift_logits", [logits32], elems * FP32, kind="logits")
    logp = b.simple("log_softmax", [scores], elems * FP32, saves=["log_softmax"], kind="logits")
    b.g.op("nll_loss", [logp], [TensorSpec("loss", LOSS_BYTES)])
    kept = logits32 if a.hf_logits_fp32_in_output else logits
    retained = (kept,) if a.hf_keeps_logits else ()
    return b.g.build(outputs=("loss",), retained=retained)


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's fused linear cross-entropy chunk: next_pow2(ceil(T / ceil(V / H))) tokens, so one chunk of
    logits is about the size of the hidden states (liger_kernel/ops/fused_linear_cross_entropy.py)."""
    inc_factor = -(-vocab // hidden)
    rows = -(-tokens // inc_factor)
    return min(tokens, 1 << max(0, (rows - 1).bit_length()))


def _liger_flce(b: BlockBuilder, hidden: str, d: LocalDims) -> Graph:
    """LigerFusedLinearCrossEntropyFunction: forward allocates the input gradient (zeros_like(hidden)), an
    fp32 per-token loss, and per chunk the logits (compute dtype), turns them into their gradient in place
    and accumulates grad_input/grad_weight; the output matrix's gradient (zeros_like(weight)) is counted
    with the model's gradients by the timeline. Backward scales the saved grad_input in place and hands it
    over as the hidden states' gradient (no new buffer)."""
    B = d.compute_bytes
    chunk = liger_chunk_tokens(d.tokens, d.vocab, d.hidden)
    grad_input = TensorSpec("flce.grad_input", d.tokens * d.hidden * B, requires_grad=False)
    fwd = [Workspace(chunk * d.vocab * B, "logits"), Workspace(chunk * d.hidden * B), Workspace(d.tokens * FP32)]
    b.g.op("liger_flce", [hidden], [TensorSpec("flce_loss", LOSS_BYTES), grad_input], saves=[grad_input.name],
           fwd_workspace=fwd, grad_from_saved=grad_input.name)
    return b.g.build(outputs=("flce_loss",))
