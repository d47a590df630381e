"""The GEMMs of one transformer layer: their shapes (dense linears, MLA projections, MoE experts as grouped
GEMMs, the router) and the timers that price them on the kernel model
(:func:`~sp_plan.cost_models.kernels.gemm_seconds`, :func:`~sp_plan.cost_models.kernels.grouped_gemm_seconds`)
at the training dtype's or fp8's rate. :mod:`sp_plan.cost_models.compute_time` composes them into a layer's
compute time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from .errors import CostModelError
from .kernels import GemmParams, gemm_seconds, grouped_gemm_seconds
from .model_spec import ModelSpec
from .topology.topology import Topology


class Rates(Protocol):
    """The asymptotic GEMM fractions a timer reads (:class:`sp_plan.cost_models.compute_time.Fractions`)."""

    matmul: float
    fp8_matmul: float
    clock: float


Gemm = tuple[float, float, float]  # (m, n, k)




def _linear_gemms(model: ModelSpec, tokens: float, tp: int, mlp_tile: float | None) -> tuple[list[Gemm], list[Gemm], float]:
    """Forward GEMMs of the attention projections and of the MLP (the latter on ``mlp_tile``-token tiles
    when tiled; returned with the number of tiles)."""
    h, hd = model.hidden_size, model.head_dim
    q_local = model.q_size / tp
    kv_local = model.num_kv_heads * model.kv_replication(tp) / tp * hd
    attn = [(tokens, q_local, h), (tokens, kv_local, h), (tokens, kv_local, h), (tokens, h, q_local)]
    f = model.ffn_hidden_size / tp
    rows = min(mlp_tile, tokens) if mlp_tile else tokens
    tiles = math.ceil(tokens / rows) if mlp_tile else 1.0
    if model.activation == "swiglu":
        mlp = [(rows, f, h), (rows, f, h), (rows, h, f)]
    else:
        mlp = [(rows, f, h), (rows, h, f)]
    return attn, mlp, tiles


def _input_grads(gemms: list[Gemm]) -> list[Gemm]:
    """The input-gradient GEMM of each forward GEMM: dX = dY @ W^T."""
    return [(m, k, n) for m, n, k in gemms]


def _weight_grads(gemms: list[Gemm]) -> list[Gemm]:
    """The weight-gradient GEMM of each forward GEMM: dW = X^T @ dY."""
    return [(k, n, m) for m, n, k in gemms]


def _backward(gemms: list[Gemm]) -> list[Gemm]:
    """Input and weight gradients of each forward GEMM."""
    return [g for pair in zip(_input_grads(gemms), _weight_grads(gemms), strict=True) for g in pair]


#: Names of a dense layer's linears, in :func:`_linear_gemms` order.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = {"swiglu": ("gate_proj", "up_proj", "down_proj")}
_MLP_PLAIN = ("fc1", "fc2")


def layer_gemm_shapes(model: ModelSpec, tokens: float, tp: int) -> list[tuple[str, str, Gemm]]:
    """``(linear, pass, (m, n, k))`` of every GEMM one dense layer runs on a rank holding ``tokens`` tokens at
    tensor-parallel degree ``tp``, exactly as :func:`compute_time` prices them (no tiled MLP, no Float8): each
    linear's forward, then its input gradient (``dgrad``) and weight gradient (``wgrad``). ``sp-plan probe
    --kernels`` times these shapes; MoE experts and MLA projections are not covered (refused there)."""
    attn, mlp, _ = _linear_gemms(model, tokens, tp, None)
    names = (*_PROJECTIONS, *_MLP.get(model.activation, _MLP_PLAIN))
    gemms = attn + mlp
    return ([(n, "forward", g) for n, g in zip(names, gemms, strict=True)]
            + [(n, "dgrad", g) for n, g in zip(names, _input_grads(gemms), strict=True)]
            + [(n, "wgrad", g) for n, g in zip(names, _weight_grads(gemms), strict=True)])


def _gemm_timer(topology: Topology, fr: Rates, gemm: GemmParams, sms: int,
                peak: float) -> Callable[..., float]:
    """``gemm_time(gemms, fp8=False, count=1)``: seconds of ``count`` runs of ``gemms`` at the clocked
    peak of the training dtype (or of fp8) and the kernel model's fractions."""

    def gemm_time(gemms: list[Gemm], fp8: bool = False, count: float = 1.0) -> float:
        p, f = _matmul_rate(topology, fr, peak, fp8)
        return count * sum(gemm_seconds(m, n, kk, p, f, gemm, sms) for m, n, kk in gemms)

    return gemm_time


def _matmul_rate(topology: Topology, fr: Rates, peak: float, fp8: bool) -> tuple[float, float]:
    """(peak FLOP/s, fraction of it) a GEMM runs at: the training dtype's, or the fp8 tensor cores'."""
    if not fp8:
        return peak, fr.matmul
    if "fp8" not in topology.gpu.peak_flops:
        raise CostModelError(f"fp8_linears needs fp8 tensor cores; {topology.gpu.name} lists none")
    return topology.peak_flops("fp8") * fr.clock, fr.fp8_matmul


#: A grouped GEMM's per-expert shapes: ``(m, n, k, experts)``, one entry per group of equally loaded experts.
GroupedGemm = list[tuple[float, float, float, float]]


def _grouped_gemm_timer(topology: Topology, fr: Rates, gemm: GemmParams, sms: int,
                        peak: float) -> Callable[[GroupedGemm, bool], float]:
    """``grouped_time(shapes, fp8=False)``: seconds of one grouped-GEMM launch over the experts' GEMMs at
    the training dtype's (or fp8's) rate, on the kernel model's grouped term
    (:func:`~sp_plan.cost_models.kernels.grouped_gemm_seconds`: the experts' tiles share the waves, a small
    per-expert ``m`` pays its padding to the tile height). One GEMM is the group of one:
    ``grouped_time([(m, n, k, 1)])`` equals :func:`~sp_plan.cost_models.kernels.gemm_seconds` (a test checks it)."""

    def grouped_time(shapes: GroupedGemm, fp8: bool = False) -> float:
        p, f = _matmul_rate(topology, fr, peak, fp8)
        return grouped_gemm_seconds(shapes, p, f, gemm, sms)

    return grouped_time


def _moe_ffn_seconds(model: ModelSpec, tokens: float, tp: int, gemm_time: Callable[..., float],
                     grouped_time: Callable[[GroupedGemm, bool], float], fp8: bool,
                     tile: float | None, ep: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE FFN on ``tokens`` local tokens (``ep`` > 1: this rank's
    ``num_experts / ep`` experts on the rows dispatched to them from all ep ranks, the busiest rank's) (in ``tile``-token tiles when a
    tiled MLP runs it): the router GEMM (tokens x experts x hidden, replicated over tp), the routed experts'
    gate, up and down projections as grouped GEMMs at their per-expert shapes
    (``MoESpec.expert_row_groups``: capacity padding, or dropless rows with the load imbalance), and the
    shared experts' GEMMs on every token. Backward: each grouped GEMM's input gradient (rows x k x n) and
    weight gradient (k x n, reduced over each expert's rows) as grouped GEMMs too."""
    moe, h = model.moe, model.hidden_size
    rows = min(tile, tokens) if tile else tokens
    tiles = math.ceil(tokens / rows) if tile else 1.0
    f = moe.expert_ffn_hidden_size / tp
    groups = moe.expert_row_groups(rows, ep)
    # gate and up (hidden -> f) share one shape, down (f -> hidden) the other: one grouped launch per matrix.
    matrices = [(f, h), (f, h), (h, f)]
    fwd = sum(grouped_time([(r, n, k, c) for r, c in groups], fp8) for n, k in matrices)
    bwd = sum(grouped_time([(r, k, n, c) for r, c in groups], fp8)  # dX = dY W^T
              + grouped_time([(k, n, r, c) for r, c in groups], fp8)  # dW = X^T dY, per expert
              for n, k in matrices)
    plain = [(rows, moe.num_experts, h)]  # router
    if moe.shared_width:
        fs = moe.shared_width / tp
        plain += [(rows, fs, h), (rows, fs, h), (rows, h, fs)]
    fwd += gemm_time(plain, fp8)
    bwd += gemm_time(_backward(plain), fp8)
    return tiles * fwd, tiles * bwd


def _mla_gemm_on_tp_rank(model: ModelSpec, tokens: float, out: int, inp: int, tp: int) -> Gemm:
    """One MLA projection on a TP rank: the latent down-projections (hidden -> q_lora_rank, hidden ->
    kv_lora_rank + rope) replicated, the up-projections column-parallel (out / tp), o_proj row-parallel."""
    h, mla = model.hidden_size, model.mla
    if inp == h and out in (mla.q_lora_rank, mla.kv_latent_width):
        return (tokens, out, inp)
    if out == h and inp == model.num_heads * mla.v_head_dim:
        return (tokens, out, inp / tp)
    return (tokens, out / tp, inp)


def _sparse_layer_gemms(model: ModelSpec, tokens: float, tp: int, mlp_tile: float | None,
                        gemm_time: Callable[..., float], grouped_time: Callable[[GroupedGemm, bool], float],
                        fp8: bool, dense_mlp: tuple[float, float], ep: int = 1) -> tuple[float, float, float, float]:
    """(projections forward, backward, FFN forward, backward) of the mean layer of a MoE and/or MLA model.

    MLA's projections run as their own GEMMs (the latent down-projections replicated over tp, see
    :meth:`~sp_plan.cost_models.moe.MLASpec.projection_gemms`); dense and MoE layers' FFN seconds are
    averaged over the layers (DeepSeek-V3: 3 dense, 58 MoE), so ``layers x`` the mean is the model's sum.
    """
    h = model.hidden_size
    if model.mla is not None:
        proj = [_mla_gemm_on_tp_rank(model, tokens, out, inp, tp) for out, inp in model.mla.projection_gemms(
            h, model.num_heads)]
        proj_f, proj_b = gemm_time(proj, fp8), gemm_time(_backward(proj), fp8)
    else:
        attn, _, _ = _linear_gemms(model, tokens, tp, None)
        proj_f, proj_b = gemm_time(attn, fp8), gemm_time(_backward(attn), fp8)
    mlp_f, mlp_b = dense_mlp
    if model.moe is not None:
        moe_f, moe_b = _moe_ffn_seconds(model, tokens, tp, gemm_time, grouped_time, fp8, mlp_tile, ep)
        sparse, layers = model.moe_layer_count, model.num_layers
        mlp_f = ((layers - sparse) * mlp_f + sparse * moe_f) / layers
        mlp_b = ((layers - sparse) * mlp_b + sparse * moe_b) / layers
    return proj_f, proj_b, mlp_f, mlp_b


def _fp8_cast_elements(model: ModelSpec, tokens: float, tp: int, ep: int, attn_g: list[Gemm], mlp_g: list[Gemm],
                       tiles: float, mlp_tile: float | None, weight_share: float = 1.0) -> tuple[float, float]:
    """Elements the fp8 casts pass over in the mean layer: forward, each fp8 GEMM's input and weight;
    backward, its output gradient. The GEMMs are the ones that run: MLA's projections, and in MoE layers the
    routed experts' grouped GEMMs on this rank's dispatched rows (``tokens x top_k`` for the ep group,
    ``MoESpec.expert_row_groups``) with its ``num_experts / ep`` experts' weights, plus the shared experts on
    every token (the router stays in bf16/fp32), averaged with the dense layers' MLP like the FFN time.
    Why: a MoE layer casts top_k x the tokens at the experts' width, not a dense MLP of ``ffn_hidden_size``
    (which Qwen3-MoE's all-MoE stack never runs). ``weight_share`` is the part of a step's weight casts one
    micro-batch pays (1 / micro-batches where the stack caches the FP8 weights, ``StackTime.fp8_weight_cache``)."""
    def forward(gemms: list[Gemm]) -> float:
        return sum(m * k + weight_share * k * n for m, n, k in gemms)

    def backward(gemms: list[Gemm]) -> float:
        return sum(m * n for m, n, _ in gemms)

    proj = attn_g
    if model.mla is not None:
        proj = [_mla_gemm_on_tp_rank(model, tokens, out, inp, tp)
                for out, inp in model.mla.projection_gemms(model.hidden_size, model.num_heads)]
    elems_f, elems_b = forward(proj), backward(proj)
    mlp_f, mlp_b = tiles * forward(mlp_g), tiles * backward(mlp_g)
    moe = model.moe
    if moe is not None:
        h, f = model.hidden_size, moe.expert_ffn_hidden_size / tp
        rows = min(mlp_tile, tokens) if mlp_tile else tokens
        groups = moe.expert_row_groups(rows, ep)
        routed = sum(r * c for r, c in groups)
        experts = sum(c for _, c in groups)
        matrices = [(f, h), (f, h), (h, f)]  # gate, up (hidden -> f), down (f -> hidden): (n, k)
        moe_f = sum(routed * k + weight_share * experts * k * n for n, k in matrices)
        moe_b = sum(routed * n for n, _ in matrices)
        if moe.shared_width:
            fs = moe.shared_width / tp
            shared = [(rows, fs, h), (rows, fs, h), (rows, h, fs)]
            moe_f, moe_b = moe_f + forward(shared), moe_b + backward(shared)
        sparse, layers = model.moe_layer_count, model.num_layers
        mlp_f = ((layers - sparse) * mlp_f + sparse * tiles * moe_f) / layers
        mlp_b = ((layers - sparse) * mlp_b + sparse * tiles * moe_b) / layers
    return elems_f + mlp_f, elems_b + mlp_b
