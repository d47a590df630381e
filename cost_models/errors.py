"""The cost-model layer's single error type.

Every problem a user can cause (unknown preset, a layout that does not multiply to the GPU count, a
sequence that cannot be split) is raised as :class:`CostModelError` with a one-line message that says
what is wrong and what would fix it. Higher layers subclass it, so the CLI catches one type and prints
the message without a traceback.
"""

from __future__ import annotations

from pydantic import ValidationError


class CostModelError(ValueError):
    """Invalid input to the cost models; the message is one actionable line."""


def explain_validation_error(error: ValidationError, what: str) -> CostModelError:
    """Turn pydantic's multi-line report into one line naming each bad field and why.

    pydantic's own text is precise but spread over several lines with URLs; users of a CLI need the
    field, the value they gave and the rule it broke.
    """
    parts = []
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()))
        message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        if item.get("type") == "extra_forbidden":
            message = "unknown field (check the spelling)"
        parts.append(f"{location}: {message}" if location else message)
    return CostModelError(f"invalid {what}: " + "; ".join(parts))
