"""Fit alpha (latency per step) and beta (seconds per byte) of a link class from measured timings.

The fit uses the same model as :mod:`sp_plan.cost_models.collectives` for a group whose members all talk over
one link class, so fitted numbers plug straight back into predictions:

    t = steps(collective, P) x alpha + wire_bytes(collective, P, n) x beta

with steps = 2(P-1) for all-reduce, P-1 for all-gather, reduce-scatter and all-to-all, 1 for a ring
send/recv step, and wire bytes = the bytes each GPU sends (the project's convention). Samples from
several collectives and message sizes are fitted jointly by non-negative least squares on *relative*
errors (each row divided by its measured time), so microsecond latencies of small messages weigh as
much as the bandwidth-bound large ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .collectives import COLLECTIVES, bytes_sent
from .errors import CostModelError
from .topology.spec import LinkCalibration

#: Fewer samples than this cannot separate latency from bandwidth reliably.
MIN_SAMPLES = 3
#: The bandwidth term must explain at least this share of the largest message's time; below it the
#: timings are latency-bound and any fitted bandwidth is noise.
MIN_BANDWIDTH_SHARE = 0.05


class TimingSample(BaseModel):
    """One measured collective: median seconds for ``nbytes`` (the collective's size argument).

    ``nominal_bandwidth``: the topology's uncalibrated per-GPU bandwidth for this collective's traffic
    pattern on the measured group (from the graph, with shared links accounted for). When every sample
    has one, the fit returns an *efficiency* (achieved / nominal) instead of an absolute bandwidth, which
    is what a topology's calibration needs when patterns congest differently (PCIe trees).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    collective: str
    group_size: int = Field(ge=2)
    nbytes: float = Field(gt=0)
    seconds: float = Field(gt=0)
    nominal_bandwidth: float | None = Field(default=None, gt=0)


class AlphaBetaFit(BaseModel):
    model_config = ConfigDict(frozen=True)

    alpha: float = Field(description="seconds per algorithm step")
    beta: float = Field(description="seconds per byte sent per GPU (absolute fits)")
    bandwidth: float | None = Field(description="1 / beta, bytes/s per GPU per direction (absolute fits)")
    efficiency: float | None = Field(description="achieved / nominal bandwidth (fits against nominal)")
    samples: int
    rms_relative_error: float
    max_relative_error: float

    def describe(self) -> str:
        rate = (f"bandwidth {self.bandwidth / 1e9:.3f} GB/s" if self.bandwidth is not None
                else f"efficiency {self.efficiency:.3f} of nominal")
        return (f"alpha {self.alpha * 1e6:.2f} us, {rate} from {self.samples} timings "
                f"(rms error {self.rms_relative_error:.1%})")


def model_terms(collective: str, group_size: int, nbytes: float) -> tuple[float, float]:
    """(steps, bytes sent per GPU) of one collective in the alpha-beta model."""
    if collective not in COLLECTIVES:
        raise CostModelError(f"unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}")
    p = group_size
    steps = {"all_reduce": 2 * (p - 1), "send_recv": 1}.get(collective, p - 1)
    return float(steps), bytes_sent(collective, nbytes, p)


def predict(collective: str, group_size: int, nbytes: float, alpha: float, beta: float) -> float:
    steps, wire = model_terms(collective, group_size, nbytes)
    return steps * alpha + wire * beta


def fit_alpha_beta(samples: Sequence[TimingSample]) -> AlphaBetaFit:
    """Non-negative weighted least squares of alpha and beta over all samples (scipy.optimize.nnls)."""
    from scipy.optimize import nnls

    if len(samples) < MIN_SAMPLES:
        raise CostModelError(
            f"{len(samples)} timings cannot separate latency from bandwidth; measure at least {MIN_SAMPLES} "
            "message sizes"
        )
    relative = all(s.nominal_bandwidth is not None for s in samples)
    if not relative and any(s.nominal_bandwidth is not None for s in samples):
        raise CostModelError("give a nominal bandwidth for every timing or for none")
    rows = np.array([model_terms(s.collective, s.group_size, s.nbytes) for s in samples], dtype=float)
    if relative:  # the second coefficient becomes 1 / efficiency
        rows[:, 1] /= np.array([s.nominal_bandwidth for s in samples], dtype=float)
    times = np.array([s.seconds for s in samples], dtype=float)
    if np.ptp(rows[:, 1]) == 0:
        raise CostModelError("all timings use the same message size; measure several sizes to fit bandwidth")
    # Scale columns to O(1) so nnls is well conditioned, and rows by 1/t for relative errors.
    scale = np.array([rows[:, 0].max() or 1.0, rows[:, 1].max()])
    design = rows / scale / times[:, None]
    solution, _ = nnls(design, np.ones_like(times))
    alpha, beta = solution / scale
    largest = int(np.argmax(rows[:, 1]))
    if beta <= 0 or beta * rows[largest, 1] < MIN_BANDWIDTH_SHARE * times[largest]:
        raise CostModelError(
            "timings do not grow with message size, so no bandwidth can be fitted; use larger messages"
        )
    predicted = rows @ np.array([alpha, beta])
    rel = predicted / times - 1.0
    return AlphaBetaFit(
        alpha=float(alpha),
        beta=float(beta),
        bandwidth=None if relative else float(1.0 / beta),
        efficiency=float(1.0 / beta) if relative else None,
        samples=len(samples),
        rms_relative_error=float(math.sqrt(float(np.mean(rel**2)))),
        max_relative_error=float(np.max(np.abs(rel))),
    )


def link_calibration(fit: AlphaBetaFit, how: str) -> LinkCalibration:
    """A topology ``calibration.links`` entry from a fit (an absolute bandwidth becomes an efficiency
    against the class's nominal bandwidth when the topology loads)."""
    text = f"{how}: {fit.describe()}"[:500]
    if fit.efficiency is not None:
        return LinkCalibration(alpha=fit.alpha, efficiency=min(fit.efficiency, 1.5), fitted_from=text)
    return LinkCalibration(alpha=fit.alpha, bandwidth=fit.bandwidth, fitted_from=text)
