"""The planner layer's error type (a :class:`CostModelError`, so one ``except`` covers both)."""

from cost_models.errors import CostModelError


class PlannerError(CostModelError):
    """The planner could not do what was asked; the message says why and what would help."""
