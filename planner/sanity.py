"""The last check before a command prints an answer: no NaN, no infinity, no negative and no absurd figure.

Every input is validated at its boundary, but a prediction combines many of them (a model, a topology, a
stack, a calibration, ``--assume`` overrides), and combinations of individually legal values can still
produce a nonsense figure: a step of 10^297 s from a matmul efficiency of 1e-300, a NaN from a zero
bandwidth. Printing such a figure as a success is worse than failing, so the commands that print
predictions (estimate, plan, capacity) pass their JSON-ready answer through :func:`check_figures`, which
raises one actionable error naming the first bad figure.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from .errors import PlannerError

#: Upper bounds on figures no real run reaches, by key name. A step of a million seconds (11.6 days) or
#: an exabyte per GPU means an input (usually an efficiency or bandwidth near zero) is wrong.
ABSURD: dict[str, float] = {
    "step_s": 1e6,
    "compute_s": 1e6,
    "comm_s": 1e6,
    "exposed_comm_s": 1e6,
    "optimizer_s": 1e6,
    "offload_s": 1e6,
    "total": 1e18,
    "peak_allocated": 1e18,
    "device_used": 1e18,
}
#: Any number beyond this is absurd whatever it measures (bytes, FLOPs, seconds, tokens) (10^30 FLOPs is
#: a million frontier-model training runs).
MAX_FIGURE = 1e30


def _numbers(data: Any, path: str) -> Iterator[tuple[str, float]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from _numbers(value, f"{path}[{i}]")
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield path, float(data)


def check_figures(data: Any, what: str) -> None:
    """Raise :class:`PlannerError` at the first NaN, infinite, negative or absurd number in ``data`` (a
    JSON-ready answer); ``what`` names the answer in the message."""
    for path, value in _numbers(data, ""):
        key = path.rsplit(".", 1)[-1]
        limit = ABSURD.get(key, MAX_FIGURE)
        if math.isfinite(value) and 0 <= value <= limit:
            continue
        problem = ("is not a number" if math.isnan(value) else "is infinite" if math.isinf(value)
                   else "is negative" if value < 0 else f"exceeds {limit:g}, which no real run reaches")
        raise PlannerError(
            f"{what}: {path} = {value:g} {problem}; an input is implausible (a --calibration, --stack or "
            "--topology value such as an efficiency or bandwidth near zero, or an --assume override), or the run "
            "is far beyond any real one (sequence length, global batch): check those inputs, or run without the "
            "files to compare")


__all__ = ["ABSURD", "MAX_FIGURE", "check_figures"]
