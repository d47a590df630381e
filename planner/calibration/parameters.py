"""Which parameters the published-data fit may move, their priors and how far.

Priors are the documented values in the kernel and stack files (``prior_kernel_model``/``prior_stack``,
never the previously fitted ones, so a refit reproduces itself). Widths are deliberately loose (a
factor of e at one sigma for asymptotic efficiencies): the files' microbenchmark figures are upper
bounds on what end-to-end training reaches, and the data should decide. Shape constants shared by all
GPUs (key-loop half length, ring-step cost, NCCL interference, HBM fraction) are fitted once for every
GPU; each GPU family's asymptotic GEMM and attention fractions are fitted only where that family has
figures (a parameter no figure depends on keeps its prior).
"""

from __future__ import annotations

from cost_models.kernels import prior_kernel_model
from cost_models.stack import prior_stack

from .fit import Parameter

#: GPU families with published end-to-end or kernel figures, and a GPU of each (for the priors).
FAMILIES = {"h100": "h100-80gb", "a100": "a100-80gb", "l20": "l20"}


def _kernel(path: str, family: str | None, lower: float, upper: float, sigma: float, gpu: str = "h100-80gb",
            space: str = "log") -> Parameter:
    prior = prior_kernel_model(FAMILIES.get(family or "", gpu)).value(path)
    return Parameter(target=f"kernels.{path}", family=family, prior=prior, lower=lower, upper=upper, sigma=sigma,
                     space=space)  # type: ignore[arg-type]


def _stack(field: str, stack: str, lower: float, upper: float, sigma: float) -> Parameter:
    prior = float(getattr(prior_stack(stack).time, field))
    return Parameter(target=f"time.{field}", stack=stack, prior=prior, lower=lower, upper=upper, sigma=sigma)


def published_fit_parameters() -> list[Parameter]:
    """The parameters ``benchmarks/accuracy.py --fit`` fits to the published throughput, kernel and
    per-layer figures."""
    params = []
    for family in ("h100", "a100"):
        params.append(_kernel("gemm.peak_fraction", family, 0.25, 0.95, 1.0))
        params.append(_kernel("attention.fa2.backward_fraction", family, 0.08, 0.9, 1.0))
    for family in ("h100", "a100", "l20"):
        params.append(_kernel("attention.fa2.forward_fraction", family, 0.08, 0.95, 1.0))
    params.append(_kernel("gemm.fp8_peak_fraction", "h100", 0.2, 0.95, 1.0))
    params.append(_kernel("attention.fa2.kv_len_half", None, 16, 8192, 1.0))
    params.append(_kernel("ring_step_s", None, 1e-6, 1e-3, 1.0))
    params.append(_kernel("nccl_compute_slowdown", None, 0.01, 0.6, 0.7))
    params.append(_kernel("memory_fraction", None, 0.3, 0.95, 0.3))
    params.append(_stack("layer_overhead_s", "torchtitan", 1e-6, 2e-2, 1.5))
    params.append(_stack("compiled_stream_fraction", "torchtitan", 0.1, 1.0, 0.5))
    params.append(_stack("layer_overhead_s", "hf-deepspeed", 1e-5, 5e-2, 1.5))
    return params


#: Run kinds the time fit uses (memory and max-length figures are predicted, not fitted here).
TIME_KINDS = ("throughput", "attention_kernel", "layer_time")
#: No shipped constant rests on one source. Leave-one-source-out folds fit whatever their remaining
#: sources constrain (a parameter fitted on one source and tested on another is exactly the test).
SHIPPED_MIN_SOURCES = 2

__all__ = ["FAMILIES", "SHIPPED_MIN_SOURCES", "TIME_KINDS", "published_fit_parameters"]
