"""The planner layer's error types (:class:`CostModelError` subclasses, so one ``except`` covers all)."""

from sp_plan.cost_models.errors import CostModelError


class PlannerError(CostModelError):
    """The planner could not do what was asked; the message says why and what would help."""


class NoFitError(PlannerError):
    """The question was valid but nothing fits (no layout, GPU count or sequence length does).

    Kept apart from bad input because the README promises scripts a different exit status: bad input
    exits 2, "no plan fits" exits 1 (with what came closest and what would make it fit).
    """
