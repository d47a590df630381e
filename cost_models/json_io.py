"""JSON in and out at the project's boundaries: reading never escapes as anything but
:class:`json.JSONDecodeError`, and writing is strict JSON (no ``NaN``/``Infinity``, which
``json.dumps`` prints by default and no JSON parser accepts)."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import CostModelError
from .yaml_io import too_long_message


def json_loads(text: str) -> Any:
    """``json.loads`` whose only error is :class:`json.JSONDecodeError`: a number of more than 4,300 digits
    (a ValueError from int()) is reported as one, so every reader's ``except JSONDecodeError`` covers it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            raise json.JSONDecodeError(too_long_message(), text, 0) from None
        raise


def _non_finite_path(data: Any, path: str = "") -> str | None:
    if isinstance(data, float) and not math.isfinite(data):
        return path or "(the value)"
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for key, value in items:
        found = _non_finite_path(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def strict_dumps(data: Any, what: str = "output", **kwargs: Any) -> str:
    """``json.dumps`` that refuses a non-finite number, naming where it is: a planning answer with NaN or
    infinity in it is a defect to report, never an output a consumer parses as something else."""
    try:
        return json.dumps(data, allow_nan=False, **kwargs)
    except ValueError as exc:
        where = _non_finite_path(data)
        if where is None:
            raise
        raise CostModelError(f"the {what} would hold a non-finite number at {where}; this is a defect of the "
                             "inputs or of sp-plan: please report it with the command line") from exc


def finite_or_null(data: Any) -> Any:
    """``data`` with each non-finite float as ``None``: for measurements (a diverged run's NaN loss) that
    must still be written as JSON, where ``null`` says "no finite value"."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite_or_null(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_null(v) for v in data]
    return data


__all__ = ["finite_or_null", "json_loads", "strict_dumps"]
