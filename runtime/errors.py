"""The runtime layer's error type.

A :class:`CostModelError` subclass, so the CLI and user code catch one family; raised for
configurations the runtime cannot execute (world size vs plan mismatch, indivisible heads, ...).
"""

from sp_plan.cost_models.errors import CostModelError


class RuntimeConfigError(CostModelError):
    """The launched job, the plan and the model disagree; the message says how to reconcile them."""
