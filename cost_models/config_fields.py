"""Reading one number of a Hugging Face ``config.json``: shared by the dense-family table
(:mod:`.hf_config`) and the mixture-of-experts/MLA readers (:mod:`.moe`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import CostModelError


def whole_number(config: Mapping[str, Any], key: str, name: str, lo: int = 1, hi: int = 1 << 22,
                 default: int | None = None) -> int:
    """A config.json number as a whole int in ``[lo, hi]``, or one clear error.

    JSON (as Python reads it) allows Infinity, NaN, 1e400, booleans, strings and fractions where a size is
    expected; int() would raise OverflowError on some, truncate others and a zero would reach a division.
    """
    value = config.get(key)
    if value is None:
        if default is not None:
            return default
        raise CostModelError(f"{name}: config.json lacks required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"{name}: config.json field {key!r} must be a whole number, not {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise CostModelError(f"{name}: config.json field {key!r} must be a finite whole number, not {value!r}")
    number = int(value)
    if not lo <= number <= hi:
        raise CostModelError(f"{name}: config.json field {key!r} is {number}; it must be between {lo} and {hi:,}")
    return number
