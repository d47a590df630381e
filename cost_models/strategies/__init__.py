"""Per-parallelism cost terms: each strategy's collectives, compute adjustments and step-time terms.

The default strategies, registered in this order (which fixes the order of the report buckets
``dp, fsdp, tp, ulysses, ring`` per layer, then ``embedding, loss, pipeline``):

- :mod:`.fsdp`: data parallelism's parameter and gradient traffic (DDP, ZeRO-1/2/3, HSDP);
- :mod:`.tp`: tensor parallelism, its vocab-parallel embedding/head, and TP-local parameter counts;
- :mod:`.ulysses`: Ulysses all-to-alls and their copies;
- :mod:`.ring`: ring attention's hops, its blockwise attention, and its hop-behind-step overlap;
- :mod:`.loss`: the loss reduction over the data group;
- :mod:`.offload`: PCIe traffic of host-resident state, and save-instead-of-recompute;
- :mod:`.optimizer`: the optimizer step, on the GPU or the host;
- :mod:`.pipeline`: pipeline stages' point-to-point activation and gradient transfers;
- :mod:`.expert`: expert parallelism's dispatch/combine all-to-alls and the experts' own ZeRO/FSDP traffic.

Add one with :func:`register` (see :mod:`.base`); nothing else needs an edit.
"""

from .base import Strategy, implementing, layer_buckets, on_change, register, registered, report_buckets, unregister
from .expert import ExpertParallel
from .fsdp import ParameterSharding
from .loss import LossReduction
from .offload import Offload
from .optimizer import OptimizerStep
from .pipeline import PipelineP2P
from .ring import RingAttention
from .terms import CommOp, ComputeContext, ComputeTime, PricedOp, Term, TimeContext
from .tp import TensorParallel
from .ulysses import Ulysses

#: The strategies every estimate sums, in registration order.
DEFAULT_STRATEGIES: tuple[Strategy, ...] = (ParameterSharding(), TensorParallel(), Ulysses(), RingAttention(),
                                            LossReduction(), Offload(), OptimizerStep(), PipelineP2P(),
                                            ExpertParallel())

for _strategy in DEFAULT_STRATEGIES:
    register(_strategy)

__all__ = ["CommOp", "ComputeContext", "ComputeTime", "DEFAULT_STRATEGIES", "PricedOp", "Strategy", "Term",
           "TimeContext", "implementing", "layer_buckets", "on_change", "register", "registered", "report_buckets",
           "unregister"]
