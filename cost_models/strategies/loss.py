"""The loss reduction: every rank holding different tokens adds its loss sum and valid-token count.

Reads the data group (every rank but TP's, :func:`.gradients.data_ranks`): one all-reduce of two fp32
scalars per micro-batch in training, exposed (the backward starts from the reduced loss).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..layout import Layout
from ..model_spec import ModelSpec
from ..train_spec import TrainSpec
from .base import Strategy
from .gradients import data_ranks
from .terms import CommOp

FP32_BYTES = 4
#: Loss reduction: the loss sum and the valid-token count, two fp32 scalars.
LOSS_REDUCTION_BYTES = 2 * FP32_BYTES


class LossReduction(Strategy):
    name = "loss"
    model_buckets = ("loss",)

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterator[CommOp]:
        if train.is_training and data_ranks(layout) > 1:
            yield CommOp("loss", "all_reduce", "data", float(LOSS_REDUCTION_BYTES), "forward", scope="model",
                         label="loss sum and valid-token count")


__all__ = ["LOSS_REDUCTION_BYTES", "LossReduction"]
