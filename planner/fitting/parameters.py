"""Which parameters the system-level fit (published end-to-end runs) may move, their priors and how far.

Kernel efficiencies and shape constants are NOT among them: they are pinned by kernel-level
measurements (:mod:`.kernel_fit`, ``cost_models/data/calibration/kernels.yaml``). An end-to-end run
mixes the kernel's speed with a power cap, a compiler's fusions and a framework's overheads, and a fit
that lets it move a kernel efficiency learns those as the kernel (issue 21: 500 W torchtitan runs with
compile and Float8 pulled the H100 FA2 backward from 0.30 to 0.175 of peak and slowed every H100 plan).
What system-level runs alone can tell, and so fit here:

- a stack's overheads (``time.<StackTime field>``: per-layer host time, compiled fusion), per stack;
- a GPU variant's sustained-clock factor (``kernels.clock_factor`` scoped to one GPU variant, a data/gpus/ file).

Priors are the documented values in the stack files and the GPU files (data/gpus/; never previously fitted ones, so a
refit reproduces itself). A parameter is shipped only when figures of two or more sources depend on it
(:data:`SHIPPED_MIN_SOURCES`); the others keep their priors.
"""

from __future__ import annotations

from sp_plan.cost_models.gpu_spec import get_gpu_preset
from sp_plan.cost_models.stack import prior_stack

from .fit import Parameter

#: The only kernel-model key a system-level fit may set, and only per GPU variant.
VARIANT_KEYS = ("clock_factor",)


def _stack(field: str, stack: str, lower: float, upper: float, sigma: float, space: str = "log") -> Parameter:
    prior = float(getattr(prior_stack(stack).time, field))
    return Parameter(target=f"time.{field}", stack=stack, prior=prior, lower=lower, upper=upper, sigma=sigma,
                     space=space)  # type: ignore[arg-type]


def _variant(gpu: str, lower: float, upper: float, sigma: float) -> Parameter:
    """The sustained-clock factor of a GPU variant (prior: its data/gpus/ file)."""
    prior = get_gpu_preset(gpu).clock_factor
    return Parameter(target="kernels.clock_factor", gpu=gpu, prior=prior, lower=lower, upper=upper, sigma=sigma)


def published_fit_parameters() -> list[Parameter]:
    """The parameters ``benchmarks/accuracy.py --fit`` fits to the published throughput, kernel-benchmark
    and per-layer figures: stack overheads and GPU-variant factors only."""
    return [
        # Execution overhead around the kernels, as a fraction of kernel time (prior 0: none); +-0.5 at
        # one sigma, so the runs decide.
        _stack("compute_overhead_fraction", "torchtitan", 0.0, 3.0, 0.5, "linear"),
        _stack("compute_overhead_fraction", "hf-deepspeed", 0.0, 3.0, 0.5, "linear"),
        _stack("layer_overhead_s", "torchtitan", 1e-6, 2e-2, 1.5),
        _stack("compiled_stream_fraction", "torchtitan", 0.1, 1.0, 0.5),
        _stack("layer_overhead_s", "hf-deepspeed", 1e-5, 5e-2, 1.5),
        _variant("h100-96gb", 0.5, 1.0, 0.15),
    ]


#: Run kinds the time fit uses (memory and max-length figures are predicted, not fitted here).
TIME_KINDS = ("throughput", "attention_kernel", "layer_time")
#: No shipped constant rests on one source. Leave-one-source-out folds fit whatever their remaining
#: sources constrain (a parameter fitted on one source and tested on another is exactly the test).
SHIPPED_MIN_SOURCES = 2

__all__ = ["SHIPPED_MIN_SOURCES", "TIME_KINDS", "VARIANT_KEYS", "published_fit_parameters"]
