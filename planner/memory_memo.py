"""One memory evaluation per distinct (model, training spec, layout, assumptions), shared by every search.

:func:`sp_plan.cost_models.memory.memory_core` is a pure function of its arguments, and the planner asks it the
same question many times over: a plan that does not fit searches once, then its advice probes the same layouts
at the same length again (``probe_feasibility``), then at other GPU counts and lengths, and ``capacity``
probes a length or a GPU count that its galloping already visited before the search that answers it. This
table answers every repeat from the first evaluation. The searches still count each call as a memory
evaluation (their statistics describe the search, not the cache).

The assumptions key on identity (the profile resolution is memoized, so searches with the same settings share
one object; hashing the many fields of the pydantic model on every call would cost more than a lookup saves);
the entry keeps the object alive, so an id is never reused while its entry stands.
"""

from __future__ import annotations

from collections.abc import Callable

from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memo import Memo
from sp_plan.cost_models.memory import MemoryAssumptions, MemoryCore, memory_core
from sp_plan.cost_models.model_spec import ModelSpec
from sp_plan.cost_models.train_spec import TrainSpec

_CORES: Memo[tuple[MemoryAssumptions, MemoryCore]] = Memo(max_entries=1 << 16)


def shared_memory_core(model: ModelSpec, train: TrainSpec, layout: Layout, assumptions: MemoryAssumptions,
                       evaluate: Callable[..., MemoryCore] = memory_core) -> MemoryCore:
    """``evaluate`` (:func:`~sp_plan.cost_models.memory.memory_core`, or the caller's reference to it) of the
    arguments, evaluated once per distinct set."""
    key = (model, train, layout, id(assumptions))
    entry = _CORES.get(key, lambda: (assumptions, evaluate(model, train, layout, assumptions)))
    if entry[0] is not assumptions:  # cannot happen while the entry holds it; kept as a guard
        entry = (assumptions, evaluate(model, train, layout, assumptions))
    return entry[1]


def clear() -> None:
    _CORES.clear()
