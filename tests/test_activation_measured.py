"""Measured vs predicted activation memory of the runtime Llama block, on CPU, in bf16.

Saved bytes: the block runs under ``SavedTensorMeter`` (``saved_tensors_hooks`` plus the selective
checkpoint's cache), deduplicated by storage, parameters and the shared RoPE tables excluded. The memory
model's per-layer prediction (``estimate(...).detail.per_layer.saved_bytes``) must be within 5%; it is
exact for every case here, because the model's tensor graph mirrors the runtime op by op. Dropout uses
``torch.native_dropout`` (a 1-byte bool mask, as CUDA's ``F.dropout``); ``F.dropout`` on CPU would save
its noise tensor in bf16 instead (2 B per element), which is the one CPU/GPU difference we found.

Whole model: embedding + blocks + final norm + lm_head + HF-style fp32 cross-entropy. Predicted = layers x
per-layer + output layer + inputs (token ids, labels, RoPE tables) minus position ids, which live on the
device but are not saved by autograd. Residual: 4 bytes, nll_loss's saved fp32 ``total_weight`` scalar.

Transient peaks: the CPU profiler's allocation timeline (``profile_memory=True``) gives the live-bytes
peak of a block's forward and backward; it is compared with the liveness simulation after accounting for
what the test harness itself holds (the input, the output and its gradient). Parameter gradients are
dropped as soon as they are accumulated (the model counts them as gradients/ZeRO buffers, not
activations). The flash-attention kernel workspace is an assumption about the GPU kernel (FA2's fp32 dQ
accumulator), not about PyTorch's CPU flash kernel (which keeps fp32 dQ, dK and dV buffers), so the peak
comparison uses MLP-dominated shapes for flash and turns those two workspace flags off.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from sp_plan.cost_models import Layout, ModelSpec, TrainSpec, get_gpu_preset  # noqa: E402
from sp_plan.cost_models.estimate import estimate  # noqa: E402
from sp_plan.cost_models.memory import MemoryAssumptions  # noqa: E402
from sp_plan.cost_models.memory.block import block_graph  # noqa: E402
from sp_plan.cost_models.memory.dims import local_dims  # noqa: E402
from sp_plan.cost_models.memory.liveness import simulate  # noqa: E402
from sp_plan.runtime.errors import RuntimeConfigError  # noqa: E402
from sp_plan.runtime.models import FlashAttention, LlamaBlock, LlamaModel, MaterializedAttention, RotaryEmbedding  # noqa: E402
from sp_plan.runtime.models.llama import _RMSNormFunction  # noqa: E402
from sp_plan.runtime.saved_tensor_meter import SavedTensorMeter  # noqa: E402

H100 = get_gpu_preset("h100-80gb")
HIDDEN, HEAD_DIM, BATCH = 64, 16, 2
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
MODES = ("none", "selective", "full")


@pytest.fixture(autouse=True)
def _one_thread():
    """Deterministic, fast CPU kernels on a shared 2-core CI box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spec(heads=(4, 2), ffn=176, dropout=0.0, qk_norm=False, layers=1, vocab=256, tied=False) -> ModelSpec:
    return ModelSpec(name="tiny", num_layers=layers, hidden_size=HIDDEN, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=HEAD_DIM, ffn_hidden_size=ffn, vocab_size=vocab, attention_dropout=dropout,
                     hidden_dropout=dropout, qk_norm=qk_norm, tied_embeddings=tied)


def kernel(name: str, dropout: float = 0.0, softmax_fp32: bool = False):
    return FlashAttention(dropout) if name == "flash" else MaterializedAttention(dropout, softmax_fp32)


def block_inputs(seq: int, dtype=torch.bfloat16):
    x = torch.randn(BATCH, seq, HIDDEN, dtype=dtype, requires_grad=True)
    cos, sin = RotaryEmbedding(HEAD_DIM)(torch.arange(seq).expand(BATCH, seq), dtype)
    return x, cos, sin


def measure_block_saved(model_spec, attn, mode, seq, dtype=torch.bfloat16) -> int:
    block = LlamaBlock(model_spec, attn, mode, dtype=dtype)
    x, cos, sin = block_inputs(seq, dtype)
    with SavedTensorMeter(exclude=[*block.parameters(), cos, sin]) as meter:
        y = block(x, cos, sin)
    y.float().sum().backward()  # the saved tensors were usable
    return meter.total_bytes


def predict_block_saved(model_spec, mode, seq, kernel_name, dtype="bf16", **assumptions) -> int:
    train = TrainSpec(seq_len=seq, micro_batch=BATCH, checkpointing=mode, attention_kernel=kernel_name, dtype=dtype)
    est = estimate(model_spec, train, Layout(), H100, MemoryAssumptions(**assumptions))
    return est.detail.per_layer.saved_bytes


def within_5_percent(predicted: int, measured: int) -> None:
    error = (predicted - measured) / measured
    assert abs(error) <= 0.05, f"predicted {predicted} vs measured {measured}: {error:+.2%}"


# ----- saved bytes per block ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [64, 192])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernel_name", ["flash", "materialized"])
def test_block_saved_bytes_match_prediction(seq, heads, mode, kernel_name):
    s = spec(HEADS[heads])
    measured = measure_block_saved(s, kernel(kernel_name), mode, seq)
    predicted = predict_block_saved(s, mode, seq, kernel_name)
    within_5_percent(predicted, measured)
    assert predicted == measured  # the graph mirrors the runtime: no residual at all


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("softmax_fp32", [False, True])
def test_materialized_with_dropout_and_fp32_softmax(mode, softmax_fp32):
    """Megatron-style accounting on the runtime block: attention and hidden dropout masks (1 B) and the
    dropped probabilities; with HF's fp32 softmax the fp32 probabilities and their bf16 cast."""
    s = spec(HEADS["GQA"], dropout=0.1)
    measured = measure_block_saved(s, kernel("materialized", 0.1, softmax_fp32), mode, 128)
    predicted = predict_block_saved(s, mode, 128, "materialized", materialized_softmax_fp32=softmax_fp32)
    within_5_percent(predicted, measured)
    assert predicted == measured


@pytest.mark.parametrize("mode", MODES)
def test_qk_norm_and_fp32(mode):
    """Qwen3-style per-head q/k RMSNorm (saves the pre-norm q, k and their fp32 rstd), in fp32."""
    s = spec(HEADS["GQA"], qk_norm=True)
    measured = measure_block_saved(s, kernel("flash"), mode, 64, dtype=torch.float32)
    assert predict_block_saved(s, mode, 64, "flash", dtype="fp32") == measured


def test_mode_order_and_what_each_mode_keeps():
    s = spec(HEADS["GQA"])
    none, selective, full = (measure_block_saved(s, kernel("flash"), m, 128) for m in MODES)
    x_in = BATCH * 128 * HIDDEN * 2
    attn_out = BATCH * 128 * 4 * HEAD_DIM * 2
    lse = BATCH * 4 * 128 * 4
    assert full == x_in
    assert selective == x_in + attn_out + lse
    assert full < selective < none


# ----- the whole model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tied", [False, True])
def test_whole_model_saved_bytes(mode, tied):
    s = spec(HEADS["GQA"], layers=2, vocab=512, tied=tied)
    model = LlamaModel(s, checkpointing=mode, dtype=torch.bfloat16)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    seq = 128
    ids = torch.randint(0, 512, (BATCH, seq))
    labels = torch.randint(0, 512, (BATCH, seq))
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        logits = model(ids)
        loss = F.cross_entropy(logits.float().view(-1, 512), labels.view(-1))  # HF: upcast, log-softmax
    loss.backward()
    detail = estimate(s, TrainSpec(seq_len=seq, micro_batch=BATCH, checkpointing=mode), Layout(), H100).detail
    position_ids = BATCH * seq * 8
    predicted = (s.num_layers * detail.per_layer.saved_bytes + detail.output_layer.saved_bytes
                 + detail.inputs_bytes - position_ids)
    within_5_percent(predicted, meter.total_bytes)
    assert meter.total_bytes - predicted == 4  # nll_loss's fp32 total_weight scalar
    assert detail.output_layer.retained_logits_bytes == logits.numel() * 2  # bf16 logits the caller holds


# ----- transient peaks -----------------------------------------------------------------------------------


def live_peak(fn) -> int:
    """Largest sum of CPU allocations minus frees while ``fn`` runs (bytes above the starting point)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


CPU_KERNEL = dict(flash_backward_dq_accum_fp32=False, flash_backward_expands_gqa=False)


@pytest.mark.parametrize("kernel_name, ffn, seq", [("flash", 344, 256), ("materialized", 32, 128)])
@pytest.mark.parametrize("mode", MODES)
def test_block_transient_peaks_match_simulation(kernel_name, ffn, seq, mode):
    s = spec(HEADS["GQA"], ffn=ffn)
    block = LlamaBlock(s, kernel(kernel_name), mode, dtype=torch.bfloat16)
    for p in block.parameters():  # parameter gradients are not activations: drop them once accumulated
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    x, cos, sin = block_inputs(seq)
    dy = torch.randn_like(x)
    held = {}
    forward_peak = live_peak(lambda: held.__setitem__("y", block(x, cos, sin)))
    backward_peak = live_peak(lambda: held["y"].backward(dy))

    train = TrainSpec(seq_len=seq, micro_batch=BATCH, checkpointing=mode, attention_kernel=kernel_name)
    graph = block_graph(s, local_dims(s, train, Layout()), MemoryAssumptions(**CPU_KERNEL), training=True,
                        attention_kernel=kernel_name, tiled_mlp=False)
    sim = simulate(graph, mode)
    x_bytes = x.numel() * 2
    # Forward: x existed before the measurement. Backward: the saved tensors, y and dy existed before;
    # the simulation counts dy but not y (in a model y is the next block's input).
    within_5_percent(sim.forward_peak.total, forward_peak + x_bytes)
    within_5_percent(sim.backward_peak.total + x_bytes, backward_peak + sum(sim.saved.values()) + 2 * x_bytes)


# ----- checkpointing is exact and selective keeps the attention ------------------------------------------


def _loss_and_grads(mode, kernel_name, dtype, dropout):
    s = spec(HEADS["GQA"], dropout=dropout, layers=2, vocab=128)
    model = LlamaModel(s, checkpointing=mode, dtype=dtype, attention_fn=kernel(kernel_name, dropout))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 128, (BATCH, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)  # same dropout masks in every mode
    loss = model(ids).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernel_name, dropout", [("flash", 0.0), ("materialized", 0.0), ("materialized", 0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpointed_gradients_equal_plain_ones_exactly(kernel_name, dropout, dtype):
    ref_loss, ref_grads = _loss_and_grads("none", kernel_name, dtype, dropout)
    for mode in ("selective", "full"):
        loss, grads = _loss_and_grads(mode, kernel_name, dtype, dropout)
        assert torch.equal(loss, ref_loss)
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), f"{mode}: gradient of {name} differs"


class _CountFlash(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, reruns", [("none", 0), ("selective", 0), ("full", 1)])
def test_selective_does_not_recompute_the_attention_kernel(mode, reruns):
    block = LlamaBlock(spec(HEADS["GQA"]), FlashAttention(), mode, dtype=torch.bfloat16)
    x, cos, sin = block_inputs(64)
    y = block(x, cos, sin)
    counter = _CountFlash()
    with counter:
        y.float().sum().backward()
    assert counter.calls == reruns


# ----- the pieces ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", list(HEADS))
def test_flash_kernel_saves_q_k_v_out_and_lse_only(heads):
    hq, hk = HEADS[heads]
    q = torch.randn(BATCH, 64, hq, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(BATCH, 64, hk, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(BATCH, 64, hk, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    with SavedTensorMeter() as meter:
        out = FlashAttention()(q, k, v, causal=True)
    shapes = sorted((s.shape, s.dtype) for s in meter.storages.values())
    expected = [(tuple(t.transpose(1, 2).shape), torch.bfloat16) for t in (q, k, v, out)]
    expected = sorted(expected + [((BATCH, hq, 64), torch.float32)])
    assert shapes == expected  # K/V are not repeated to the query heads


@pytest.mark.parametrize("causal", [True, False])
def test_flash_and_materialized_attention_agree(causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, 48, 4, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(BATCH, 48, 2, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(BATCH, 48, 2, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    outs = []
    for attn in (FlashAttention(), MaterializedAttention()):
        out = attn(q, k, v, causal=causal)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        outs.append((out, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b)


def test_rmsnorm_function_gradcheck_and_matches_eager():
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFunction.apply(a, b, 1e-5), (x, w))
    eager = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(_RMSNormFunction.apply(x, w, 1e-5), eager)


def test_runtime_model_rejects_non_llama_specs_and_ties_embeddings():
    from sp_plan.cost_models import get_model_preset

    with pytest.raises(RuntimeConfigError, match="activation='gelu'"):
        LlamaModel(get_model_preset("gpt3-6.7b").model_copy(update={"num_layers": 1}), device="meta")
    tied = LlamaModel(spec(tied=True, vocab=64))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    with pytest.raises(RuntimeConfigError, match="unknown checkpointing mode"):
        tied.set_checkpointing("sometimes")
