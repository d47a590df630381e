"""A layout degree added the way a new one is: this module plus :func:`register` (no other file edited).

``dp_outer`` is a second replicated data-parallel degree, outermost in the mesh (e.g. across pods). It plays
the ``data`` role and shards nothing, so the planner, the cost model and the runtime must treat it as they
treat ``dp_replicate``: different samples per coordinate, gradients all-reduced across it (HSDP).
"""

from sp_plan.cost_models.degrees import Degree, register_degree, registered, unregister_degree

DP_OUTER = Degree("dp_outer", -10, frozenset({"data"}), "Replicated data-parallel degree across pods.",
                  search="split")


def register() -> None:
    if DP_OUTER.name not in registered():
        register_degree(DP_OUTER)


def unregister() -> None:
    unregister_degree(DP_OUTER.name)
