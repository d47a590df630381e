"""Ulysses (DeepSpeed-Ulysses) sequence parallelism: all-to-alls around attention, and their copies.

Reads the ``ulysses`` degree U (and the TP-local head counts: the all-to-all moves this TP rank's heads).
With T = b S / (U R) tokens per GPU, rep = ``model.kv_replication(tp x U)``: forward all-to-alls of Q
(T x heads/tp x head_dim x d), K and V (T x kv_heads x rep / tp x head_dim x d: KV heads are
replicated *before* the all-to-all when the head split exceeds them) and of the output (same size as
Q). Backward: dO, dQ, dK, dV, the same bytes (replica gradients are summed locally). Recompute repeats
the forward all-to-alls (``full``) or those of Q, K and V (``selective``: not the attention output).
All are exposed: the next kernel needs their result.

Compute: the stack's copy passes around each all-to-all (``alltoall_copy_passes``: the packing into and
out of the all-to-all layout), read and written once per pass, forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..layout import Layout
from ..model_spec import ModelSpec
from ..train_spec import TrainSpec
from .base import Strategy
from .terms import CommOp, ComputeContext
from .tp import merged


class Ulysses(Strategy):
    name = "ulysses"
    layer_buckets = ("ulysses",)
    attention_traffic = True

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        if layout.ulysses == 1:
            return
        d, tp = train.dtype_bytes, layout.tp
        tokens = train.micro_batch * train.seq_len / layout.sp
        rep = model.kv_replication(layout.head_split)
        q_buf = tokens * (model.num_heads / tp) * model.head_dim * d
        kv_buf = tokens * (model.num_kv_heads * rep / tp) * model.head_dim * d
        a2a = "all_to_all"
        fwd = [(a2a, q_buf, "Q"), (a2a, kv_buf, "K"), (a2a, kv_buf, "V"), (a2a, q_buf, "output")]
        yield from merged("ulysses", "ulysses", "forward", fwd)
        if not train.is_training:
            return
        bwd = [(a2a, q_buf, "dO"), (a2a, q_buf, "dQ"), (a2a, kv_buf, "dK"), (a2a, kv_buf, "dV")]
        yield from merged("ulysses", "ulysses", "backward", bwd)
        ckpt = train.checkpointing
        again = fwd if ckpt == "full" else fwd[:3] if ckpt == "selective" else []
        yield from merged("ulysses", "ulysses", "backward", [(c, n, f"{lb} (recompute)") for c, n, lb in again],
                          recompute=True)

    def layer_kernels(self, cc: ComputeContext) -> Mapping[str, tuple[float, float]]:
        layout, model = cc.layout, cc.model
        if layout.ulysses == 1:
            return {}
        tp, d, hd = layout.tp, cc.train.dtype_bytes, model.head_dim
        q_local = cc.tokens * model.num_heads / tp * hd * d
        kv_local = cc.tokens * model.num_kv_heads * model.kv_replication(layout.head_split) / tp * hd * d
        copies = cc.stack.alltoall_copy_passes * 2 * (2 * q_local + 2 * kv_local) / cc.hbm  # read + write, q k v out
        return {"ulysses_copies": (copies, copies)}


__all__ = ["Ulysses"]
