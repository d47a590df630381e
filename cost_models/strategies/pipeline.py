"""Pipeline parallelism's point-to-point traffic: activations forward and gradients back across stage
boundaries.

Per micro-batch, every stage receives its input activation and sends its output forward, and in backward
receives the output's gradient and sends the input's gradient back: ``micro_batch x seq_len / sp x hidden``
in the compute dtype each (split over TP too under Megatron sequence parallelism;
:func:`sp_plan.cost_models.pipeline.p2p_bytes`). Interleaved 1F1B crosses ``virtual_stages`` boundaries per
stage and micro-batch (Narayanan et al. 2021, section 2.2.2: the bubble shrinks ``v``-fold at ``v`` times the
traffic). The transfers run over the ``pp`` group, outermost in the mesh, so on a multi-node layout they
cross the fabric. A stage cannot start a micro-batch's forward (backward) before its input (gradient)
arrived, so each transfer is on the critical path once per micro-batch and pass (Megatron batches the
send and the receive of neighbouring stages into one ``batch_isend_irecv``, which this counts as one
transfer): whole-model ops, exposed, once per micro-batch. The bubble and the stage times are the schedule's (:mod:`sp_plan.cost_models.pipeline`,
composed in :mod:`sp_plan.cost_models.time_model`).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..layout import Layout
from ..model_spec import ModelSpec
from ..pipeline import p2p_bytes
from ..train_spec import TrainSpec
from .base import Strategy
from .terms import CommOp


class PipelineP2P(Strategy):
    name = "pipeline"
    model_buckets = ("pipeline",)

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        if layout.pp == 1 or not train.is_training:
            return
        nbytes = p2p_bytes(model, train, layout)
        hops = train.virtual_stages
        yield CommOp("pipeline", "send_recv", "pp", nbytes, "forward", scope="model", count=hops,
                     label="stage activation send/recv")
        yield CommOp("pipeline", "send_recv", "pp", nbytes, "backward", scope="model", count=hops,
                     label="stage gradient send/recv")
