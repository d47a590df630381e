"""Layout search, what-if capacity questions, config export and the ``sp-plan`` CLI.

Depends on :mod:`cost_models`; never imports torch.
"""

from .errors import PlannerError

__all__ = ["PlannerError"]
