"""FLOPs and memory traffic of one micro-batch, per GPU, by kind of work.

Kinds are kept apart because they run at different fractions of peak (see the topology's
``calibration.compute``): dense matmuls, attention forward, attention backward, and streaming
(memory-bound) kernels, whose cost is bytes moved rather than FLOPs.

Counting rules (a multiply-add is 2 FLOPs):

- Matmuls per layer, forward: 2 x tokens x (TP-local weight parameters). A GPU projects its
  T = b S / (U R) tokens (Ulysses and Ring split the sequence before the projections) with its TP
  shard of the weights. LM head: 2 x T x hidden x vocab / tp (prefill: the last token only).
- Attention forward: QK^T and PV, 4 x b x head_dim x heads x (query, key) pairs, split evenly over
  all tp x U x R ranks (zigzag balances causal work). Flash kernels skip fully masked blocks: causal
  attention has S(S+1)/2 pairs; a sliding window w < S leaves S w - w(w-1)/2 (in the layers that use
  it: the per-layer figures are the mean over the layers). A materialized (eager) attention computes
  all S^2 pairs and masks.
- Backward: matmuls 2x forward (input and weight gradients); FlashAttention's backward is 2.5x its
  forward (five GEMMs instead of two: it recomputes QK^T); materialized attention's backward is 2x.
- Recompute: ``full`` checkpointing re-runs the block forward (matmuls and attention); ``selective``
  re-runs the matmuls (projections, MLP) but not attention. Tiled MLP recomputes its tiles' forward in
  backward; tiled loss recomputes the LM head forward per chunk in backward.
- Model FLOPs (for MFU) count forward + 2x backward of the matmuls and of causal attention, without
  recompute and without FlashAttention's backward surplus; hardware FLOPs count what actually runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .layout import Layout
from .memo import Memo
from .model_spec import ModelSpec
from .train_spec import TrainSpec

T = TypeVar("T")

#: Backward/forward FLOP ratios. Dense layers: dX and dW, each the size of the forward GEMM.
MATMUL_BACKWARD_RATIO = 2.0
#: FlashAttention backward: recompute S = QK^T, then dV, dP, dQ, dK: 5 GEMMs vs 2 forward.
FLASH_BACKWARD_RATIO = 2.5
#: Materialized attention backward: dV, dP, dQ, dK from the saved probabilities: 4 GEMMs vs 2.
MATERIALIZED_BACKWARD_RATIO = 2.0
#: A materialized attention writes the score matrix, reads it for the softmax, writes the
#: probabilities and reads them for PV: four passes over (heads x S_q x S_k) in the compute dtype.
MATERIALIZED_FORWARD_PASSES = 4
#: Its backward reads the probabilities, writes and reads dP and writes dS: four more passes, twice
#: over because the softmax backward also needs P and dP together.
MATERIALIZED_BACKWARD_PASSES = 8
#: Streaming kernels' backward moves about twice the forward's bytes (read activations and
#: upstream gradients, write input gradients, accumulate norm-weight gradients).
ELEMENTWISE_BACKWARD_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class MicrobatchWork:
    """Per GPU, one micro-batch. FLOPs for compute-bound work, bytes for memory-bound work.

    ``layer_*`` are per transformer layer; ``head_*`` cover the LM head (and loss). ``*_recompute``
    is the recomputation done during backward (already excluded from ``*_bwd``).
    """

    layer_matmul_fwd: float
    layer_matmul_bwd: float
    layer_matmul_recompute: float
    layer_attn_fwd: float
    layer_attn_bwd: float
    layer_attn_recompute: float
    layer_stream_fwd_bytes: float
    layer_stream_bwd_bytes: float
    layer_stream_recompute_bytes: float
    head_matmul_fwd: float
    head_matmul_bwd: float
    model_flops: float  # per GPU per micro-batch, for MFU (no recompute, causal attention x 3)

    def executed_flops(self, num_layers: int) -> float:
        """FLOPs this GPU actually runs per micro-batch (recompute and flash's backward included)."""
        per_layer = (self.layer_matmul_fwd + self.layer_matmul_bwd + self.layer_matmul_recompute
                     + self.layer_attn_fwd + self.layer_attn_bwd + self.layer_attn_recompute)
        return num_layers * per_layer + self.head_matmul_fwd + self.head_matmul_bwd


def causal_pairs(length: float, window: int | None = None) -> float:
    """(query, key) pairs of causal attention over ``length`` tokens where each query sees at most
    ``window`` keys (itself included): ``L (L + 1) / 2`` without a window or when ``window >= L``, else
    ``L w - w (w - 1) / 2`` (the first w queries see all keys before them, the rest w keys each)."""
    if window is None or window >= length:
        return length * (length + 1) / 2
    return length * window - window * (window - 1) / 2


def attention_pairs(seq_len: int, causal_skip: bool, document_length: int | None = None,
                    window: int | None = None) -> float:
    """(query, key) pairs computed for one sequence: causal flash skips the masked half; with packed
    documents (document masking) only pairs inside a document of ``document_length`` tokens count; with a
    sliding ``window`` only pairs inside it (flash skips the blocks outside; a materialized attention
    computes every pair and masks, window or not)."""
    if window is not None and causal_skip:
        if document_length is not None and document_length < seq_len:
            return seq_len / document_length * causal_pairs(document_length, window)
        return causal_pairs(seq_len, window)
    if document_length is not None and document_length < seq_len and causal_skip:
        return seq_len / document_length * document_length * (document_length + 1) / 2
    return seq_len * (seq_len + 1) / 2 if causal_skip else float(seq_len) * seq_len


def mean_over_layers(model: ModelSpec, seq_len: int, per_window: Callable[[int | None], T]) -> T:
    """The per-layer mean of ``per_window(window)`` over the model's attention layers (window ``None``:
    full causal attention). Costs are summed over layers as ``num_layers x`` one layer's, so a model whose
    layers differ (Gemma 2's alternating local/global attention) is priced by this exact mean. A model
    with one kind of layer gets ``per_window`` itself, bit for bit. ``T`` is a float or a tuple of floats."""
    groups = model.attention_layer_groups(seq_len)
    if len(groups) == 1:
        return per_window(groups[0][0])
    values = [(per_window(window), layers) for window, layers in groups]
    if isinstance(values[0][0], tuple):
        width = len(values[0][0])
        return tuple(sum(v[i] * n for v, n in values) / model.num_layers for i in range(width))  # type: ignore[return-value]
    return sum(v * n for v, n in values) / model.num_layers  # type: ignore[return-value]


#: ``call(batch_heads, q_len, kv_len, causal, backward) -> seconds`` of one flash-attention call
#: (``ComputeContext.attention_seconds``).
AttentionCall = Callable[[float, float, float, bool, bool], float]


def windowed_attention_seconds(call: AttentionCall, launch_s: float, batch_heads: float, length: float,
                               window: int | None, backward: bool) -> float:
    """Seconds of one causal flash-attention call over ``length`` tokens whose queries see at most
    ``window`` keys (FlashAttention-2's ``window_size``: blocks wholly outside the band are skipped).
    Without a window, or one not shorter than the call, it is the plain causal call. Otherwise it is
    priced as what it computes: the first ``window`` queries form a causal block, the others a band of
    ``window`` keys each (a rectangle of that many pairs; one kernel, so one launch, ``launch_s``). The
    band's partly masked edge tiles are not charged separately (about tile / window of the band's work)."""
    if window is None or window >= length:
        return call(batch_heads, length, length, True, backward)
    head = call(batch_heads, window, window, True, backward)
    band = call(batch_heads, length - window, window, False, backward)
    return head + band - launch_s


def band_pairs(q_lo: float, q_hi: float, k_lo: float, k_hi: float, window: int) -> float:
    """Causal pairs inside a sliding ``window`` between queries at positions ``[q_lo, q_hi)`` and keys at
    ``[k_lo, k_hi)``: pairs (i, j) with ``i - window < j <= i`` (a ring step's block with window skipping)."""
    return max(0.0, _pairs_below(q_lo, q_hi, k_hi, window) - _pairs_below(q_lo, q_hi, k_lo, window))


def _pairs_below(q_lo: float, q_hi: float, k_end: float, window: int) -> float:
    """Pairs (i, j) with i in ``[q_lo, q_hi)``, ``j < k_end`` and ``i - window < j <= i``: query i counts
    ``clip(k_end + window - 1 - i, 0, window)`` keys (each of its ``window`` keys that lies below k_end)."""
    top = k_end + window - 1  # queries at i <= top - window count the whole window, none at i >= top

    def prefix(n: float) -> float:  # sum over integer i in [0, n) of clip(top - i, 0, window)
        n = max(0.0, n)
        full = min(n, max(0.0, top - window + 1))
        ramp_end = min(n, max(0.0, top))
        ramp = max(0.0, ramp_end - full)  # i in [full, ramp_end): top - i, an arithmetic series
        return full * window + ramp * (top - full) - ramp * (ramp - 1) / 2

    return prefix(q_hi) - prefix(q_lo)


#: TrainSpec fields the work of a micro-batch depends on (the rest, e.g. ZeRO or offloading, moves
#: bytes but adds no FLOPs): the cache key, so option combinations that differ only elsewhere share it.
WORK_FIELDS = ("mode", "micro_batch", "seq_len", "dtype", "attention_kernel", "tp_sequence_parallel",
               "checkpointing", "tiled_mlp", "tiled_loss", "document_length", "data")


def microbatch_work(model: ModelSpec, train: TrainSpec, layout: Layout) -> MicrobatchWork:
    """FLOPs and streamed bytes of one micro-batch on one GPU (depends on tp, ulysses and ring only)."""
    tp, u, r = layout.tp, layout.ulysses, layout.ring
    key = (model, tp, u, r, *(getattr(train, f) for f in WORK_FIELDS))
    return _WORK.get(key, lambda: _work(model, tp, u, r, train))


_WORK: Memo[MicrobatchWork] = Memo()


def _work(model: ModelSpec, tp: int, u: int, r: int, train: TrainSpec) -> MicrobatchWork:
    training = train.is_training
    b, s, d = train.micro_batch, train.seq_len, train.dtype_bytes
    ranks = tp * u * r
    tokens = b * s / (u * r)
    h, f = model.hidden_size, model.ffn_hidden_size
    hd = model.head_dim
    flash = train.attention_kernel == "flash"

    # Matmul weights one TP rank multiplies by (KV projections replicated when tp exceeds the KV
    # heads), and the unique weights per rank for model FLOPs (replicas are not useful work).
    mlp_weights = (3 if model.activation == "swiglu" else 2) * h * f / tp
    kv_local = model.num_kv_heads * model.kv_replication(tp) / tp * hd
    weights = 2 * h * model.q_size / tp + 2 * h * kv_local + mlp_weights
    unique = (2 * h * model.q_size + 2 * h * model.kv_size) / tp + mlp_weights
    if model.moe is not None or model.mla is not None:
        sparse = sparse_matmul_weights(model, tp, b * s / (u * r))
        mlp_weights = sparse.ffn_executed
        weights, unique = sparse.executed, sparse.active
    matmul_fwd = 2 * tokens * weights
    matmul_model = 2 * tokens * unique
    mlp_fwd = 2 * tokens * mlp_weights

    attn_core = 4 * b * hd * model.num_heads / ranks  # per pair, per GPU
    model_core = attn_core
    if model.mla is not None:
        # Model FLOPs: QK^T over qk_nope + qk_rope, PV over v_head_dim. The kernel runs PV at the qk head dim
        # (flash_attention_2 needs one head dim: HF pads V, memory/mla_block.py), so executed FLOPs keep 4 hd.
        model_core = 2 * b * (model.mla.qk_head_dim + model.mla.v_head_dim) * model.num_heads / ranks
    # Sliding-window layers count only the pairs inside their window (the mean over the layers' kinds).
    doc = train.attention_document_length
    attn_fwd = attn_core * mean_over_layers(model, s, lambda w: attention_pairs(s, flash, doc, w))
    attn_model = model_core * mean_over_layers(model, s, lambda w: attention_pairs(s, True, doc, w))

    # Streaming kernels, bytes per forward: two norms (read + write h), two residual adds (2 reads +
    # 1 write of h), rotary embedding on the local Q and K (read + write), and the activation
    # (SwiGLU reads gate and up, writes one; GELU reads and writes). With Megatron sequence
    # parallelism the norms and residuals run on T / tp tokens.
    rep = model.kv_replication(tp * u)  # the head split
    norm_tokens = tokens / tp if (tp > 1 and train.tp_sequence_parallel) else tokens
    q_local = model.num_heads / tp * hd
    k_local = model.num_kv_heads * rep / tp * hd
    act = (3 if model.activation == "swiglu" else 2) * f / tp
    if model.moe is not None:
        act = sparse.activation_width + sparse.permute_width
    norms = model.norms_per_layer
    stream_fwd = d * (norm_tokens * (norms * 2 * h + 2 * 3 * h) + tokens * (2 * (q_local + k_local) + act))
    if not flash:
        scores = b * (model.num_heads / (tp * u)) * (s / r) * s * d
        stream_fwd += MATERIALIZED_FORWARD_PASSES * scores
    attn_bwd_ratio = FLASH_BACKWARD_RATIO if flash else MATERIALIZED_BACKWARD_RATIO

    head_tokens = tokens if training else b / (u * r)  # prefill: logits of the last token only
    head_fwd = 2 * head_tokens * h * model.vocab_size / tp

    if not training:
        return MicrobatchWork(matmul_fwd, 0.0, 0.0, attn_fwd, 0.0, 0.0, stream_fwd, 0.0, 0.0, head_fwd, 0.0,
                              model.num_layers * (matmul_model + attn_model) + head_fwd)
    ckpt = train.checkpointing
    matmul_re = matmul_fwd if ckpt in ("full", "selective") else 0.0
    if train.tiled_mlp:
        matmul_re += mlp_fwd  # TiledMLP recomputes each tile's forward in backward
    attn_re = attn_fwd if ckpt == "full" else 0.0
    stream_re = stream_fwd if ckpt in ("full", "selective") else 0.0
    if ckpt == "selective" and not flash:
        stream_re -= MATERIALIZED_FORWARD_PASSES * scores  # the attention op is not recomputed
    stream_bwd = ELEMENTWISE_BACKWARD_RATIO * stream_fwd
    if not flash:
        stream_bwd += (MATERIALIZED_BACKWARD_PASSES - ELEMENTWISE_BACKWARD_RATIO * MATERIALIZED_FORWARD_PASSES) * scores
    head_bwd = MATMUL_BACKWARD_RATIO * head_fwd + (head_fwd if train.tiled_loss else 0.0)
    model_flops = (1 + MATMUL_BACKWARD_RATIO) * (model.num_layers * (matmul_model + attn_model) + head_fwd)
    return MicrobatchWork(
        layer_matmul_fwd=matmul_fwd,
        layer_matmul_bwd=MATMUL_BACKWARD_RATIO * matmul_fwd,
        layer_matmul_recompute=matmul_re,
        layer_attn_fwd=attn_fwd,
        layer_attn_bwd=attn_bwd_ratio * attn_fwd,
        layer_attn_recompute=attn_re,
        layer_stream_fwd_bytes=stream_fwd,
        layer_stream_bwd_bytes=stream_bwd,
        layer_stream_recompute_bytes=stream_re,
        head_matmul_fwd=head_fwd,
        head_matmul_bwd=head_bwd,
        model_flops=model_flops,
    )


@dataclass(frozen=True, slots=True)
class SparseWeights:
    """Per-token matmul weights of the mean layer on one TP rank for MoE and/or MLA models.

    ``executed``: what the GPU multiplies each local token by (routed rows padded to capacity, replicated
    MLA down-projections and router included); ``active``: the useful part for model FLOPs (the top-k
    experts, each matrix once over the TP group); ``ffn_executed``: the FFN share of ``executed`` (what a
    tiled MLP recomputes). ``activation_width`` and ``permute_width``: elements per token the SwiGLU of the
    FFN and the token permutation (dispatch gather + combine scatter, read and write) stream.
    """

    executed: float
    active: float
    ffn_executed: float
    activation_width: float
    permute_width: float


def sparse_matmul_weights(model: ModelSpec, tp: int, tokens: float) -> SparseWeights:
    """Per-token weights of the mean layer (dense and MoE layers averaged) for ``tokens`` local tokens.

    MoE FFN: rows per token = ``routed_rows(tokens) / tokens`` (top_k dropless; experts x capacity / tokens
    with a capacity factor) through one expert's SwiGLU (3 h f_e / tp), the shared experts' SwiGLU on
    every token, and the router (h x experts, replicated over tp). Model FLOPs count top_k experts only
    (Megatron's and torchtitan's MoE MFU: the active parameters). MLA: its projection matrices
    (:meth:`~sp_plan.cost_models.moe.MLASpec.projection_gemms`), the latent ones replicated over tp.
    """
    h, layers = model.hidden_size, model.num_layers
    if model.mla is not None:
        gemms = model.mla.projection_gemms(h, model.num_heads)
        replicated = {model.mla.q_lora_rank, model.mla.kv_latent_width}  # down-projection widths
        attn_exec = sum(o * i / (1 if o in replicated and i == h else tp) for o, i in gemms)
        attn_unique = sum(o * i for o, i in gemms) / tp
    else:
        kv_local = model.num_kv_heads * model.kv_replication(tp) / tp * model.head_dim
        attn_exec = 2 * h * model.q_size / tp + 2 * h * kv_local
        attn_unique = (2 * h * model.q_size + 2 * h * model.kv_size) / tp
    mats = 3 if model.activation == "swiglu" else 2
    dense_ffn = mats * h * model.ffn_hidden_size / tp
    moe = model.moe
    if moe is None:
        return SparseWeights(attn_exec + dense_ffn, attn_unique + dense_ffn, dense_ffn, mats * model.ffn_hidden_size / tp, 0.0)
    sparse, dense = model.moe_layer_count, layers - model.moe_layer_count
    rows = moe.routed_rows(tokens) / tokens if tokens else moe.top_k
    expert = 3 * h * moe.expert_ffn_hidden_size / tp
    shared = 3 * h * moe.shared_width / tp
    router = h * moe.num_experts
    moe_exec = rows * expert + shared + router
    moe_active = moe.top_k * expert + shared + router / tp
    ffn_exec = (dense * dense_ffn + sparse * moe_exec) / layers
    ffn_active = (dense * dense_ffn + sparse * moe_active) / layers
    act = (dense * mats * model.ffn_hidden_size / tp
           + sparse * 3 * (rows * moe.expert_ffn_hidden_size + moe.shared_width) / tp) / layers
    permute = sparse * 4 * rows * h / layers
    return SparseWeights(attn_exec + ffn_exec, attn_unique + ffn_active, ffn_exec, act, permute)


def model_flops_per_step(model: ModelSpec, train: TrainSpec, layout: Layout) -> float:
    """Model FLOPs of one optimizer step over the whole cluster (the MFU numerator)."""
    work = microbatch_work(model, train, layout)
    return work.model_flops * layout.world * train.grad_accum
