"""The strategy protocol and the registry the cost models sum over.

A strategy is one parallelism (or one technique with a cost of its own, such as offloading) seen by
the cost models. It owns, in its own module, everything the models need to know about it:

- :meth:`Strategy.comm_ops`: the collectives it issues per layer and per model pass;
- :meth:`Strategy.layer_kernels`, :meth:`Strategy.attention_pass`, :meth:`Strategy.keeps_activations`:
  how it changes one layer's compute;
- :meth:`Strategy.exposed` (with :meth:`Strategy.condense`): step-time terms that no generic overlap
  rule covers.

``comm_volume``, ``compute_time`` and ``time_model`` iterate over :func:`registered` strategies and
sum what they contribute; the overlap rules (which op hides behind which compute) live once, in
``time_model``. A new parallelism is one module with one :class:`Strategy` subclass and one
:func:`register` call. Every hook has a neutral default, so a strategy overrides only what it changes.

The registry is ordered: strategies issue their ops in registration order, and their report buckets
are listed layer buckets first, then model buckets, each in registration order. Registering or
unregistering notifies :func:`on_change` listeners, which the models use to drop memoized results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

from ..errors import CostModelError
from ..layout import Layout
from ..model_spec import ModelSpec
from ..stack import StackTime
from ..train_spec import TrainSpec
from .terms import CommOp, ComputeContext, PricedOp, Term, TimeContext


class Strategy:
    """Base of every strategy: no traffic, no compute change, no extra time (override what applies).

    Class attributes: ``name`` (unique; the registry key); ``layer_buckets`` and ``model_buckets`` (the
    report buckets its ops count under, per layer and outside the layers; the ``comm`` JSON lists layer
    buckets per layer); ``overlap_classes`` (``CommOp.overlap`` values whose ops it prices itself in
    :meth:`exposed`, handed to it priced, through :meth:`condense`, in ``TimeContext.priced``);
    ``attention_traffic`` (its per-layer forward traffic belongs to the attention op, so an attention
    benchmark counts it).
    """

    name: ClassVar[str] = ""
    layer_buckets: ClassVar[tuple[str, ...]] = ()
    model_buckets: ClassVar[tuple[str, ...]] = ()
    overlap_classes: ClassVar[tuple[str, ...]] = ()
    attention_traffic: ClassVar[bool] = False

    def comm_ops(self, model: ModelSpec, train: TrainSpec, layout: Layout) -> Iterable[CommOp]:
        """The collectives of one step this strategy issues (bytes per the ``comm_volume`` conventions).
        Read only the TrainSpec fields in ``time_model.COMM_FIELDS``: the op list is memoized on them."""
        return ()

    def keeps_activations(self, train: TrainSpec, stack: StackTime) -> bool:
        """Whether the layer's saved activations are kept (somewhere) instead of recomputed in backward.
        Read only ``train.offload_checkpoints`` beyond ``compute_time.COMPUTE_FIELDS``."""
        return False

    def attention_pass(self, cc: ComputeContext, backward: bool) -> tuple[float, float] | None:
        """Seconds of one flash-attention pass when this strategy changes how attention runs (e.g. in
        ring steps), and the share of one step a transfer can hide behind; ``None`` leaves the single
        causal call over the whole sequence. The first strategy that answers prices attention."""
        return None

    def layer_kernels(self, cc: ComputeContext) -> Mapping[str, tuple[float, float]]:
        """Extra kernel seconds per layer this strategy runs, by compute part: part -> (forward,
        backward). They are scaled by the stack's compute overhead like every other kernel."""
        return {}

    def condense(self, overlap_class: str, ops: tuple[PricedOp, ...]) -> object:
        """What ``TimeContext.priced[overlap_class]`` holds for one of this strategy's overlap classes:
        the ops priced on the topology (default), or a summary of them. It is computed once per layout
        and topology and memoized with the prices, so :meth:`exposed` (run per option combination)
        does only the arithmetic that depends on compute time."""
        return ops

    def exposed(self, ctx: TimeContext) -> Iterable[Term]:
        """Step-time terms beyond the ops the generic overlap rules price (those of its
        ``overlap_classes``, the host-side work of an offload, ...)."""
        return ()


_REGISTRY: dict[str, Strategy] = {}
_ORDER: list[Strategy] = []
_LISTENERS: list[Callable[[], None]] = []
_BUCKETS: list[tuple[str, ...]] = [(), ()]  # (layer buckets, every bucket) of the registered strategies
#: Hook name -> the registered strategies that override it (the models' hot loops skip the others).
_HOOKED: dict[str, tuple[Strategy, ...]] = {}
HOOKS = ("comm_ops", "keeps_activations", "attention_pass", "layer_kernels", "condense", "exposed")


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` after those registered so far; its name and buckets must be new."""
    if not strategy.name:
        raise CostModelError(f"strategy {type(strategy).__name__} has no name")
    if strategy.name in _REGISTRY:
        raise CostModelError(f"a strategy named {strategy.name!r} is already registered")
    taken = set(report_buckets())
    clash = taken.intersection(strategy.layer_buckets + strategy.model_buckets)
    if clash:
        raise CostModelError(f"strategy {strategy.name!r} reports under buckets already taken: {sorted(clash)}")
    owned = {c for s in _ORDER for c in s.overlap_classes}
    if owned.intersection(strategy.overlap_classes) or {"exposed", "prefetch", "grad"} & set(strategy.overlap_classes):
        raise CostModelError(f"strategy {strategy.name!r} claims an overlap class already priced elsewhere")
    _REGISTRY[strategy.name] = strategy
    _ORDER.append(strategy)
    _changed()
    return strategy


def unregister(name: str) -> Strategy:
    """Remove the strategy called ``name`` (and with it its traffic, compute and time)."""
    strategy = _REGISTRY.pop(name, None)
    if strategy is None:
        raise CostModelError(f"no strategy named {name!r} is registered")
    _ORDER.remove(strategy)
    _changed()
    return strategy


def registered() -> tuple[Strategy, ...]:
    """The strategies in registration order."""
    return tuple(_ORDER)


def implementing(hook: str) -> tuple[Strategy, ...]:
    """The registered strategies, in order, whose class overrides ``hook`` (one of :data:`HOOKS`): the
    planner times thousands of combinations, so the models call a hook only where it does something."""
    return _HOOKED[hook]


def layer_buckets() -> tuple[str, ...]:
    """Report buckets with per-layer traffic, in registration order (the ``comm`` JSON's per-layer keys)."""
    return _BUCKETS[0]


def report_buckets() -> tuple[str, ...]:
    """Every report bucket: the layer buckets, then the buckets of traffic outside the layers."""
    return _BUCKETS[1]


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever a strategy is registered or unregistered (to drop memoized results)."""
    _LISTENERS.append(listener)


def _changed() -> None:
    layer = tuple(b for s in _ORDER for b in s.layer_buckets)
    _BUCKETS[:] = [layer, layer + tuple(b for s in _ORDER for b in s.model_buckets)]
    for hook in HOOKS:
        _HOOKED[hook] = tuple(s for s in _ORDER if getattr(type(s), hook) is not getattr(Strategy, hook))
    for listener in _LISTENERS:
        listener()


_changed()

__all__ = ["HOOKS", "Strategy", "implementing", "layer_buckets", "on_change", "register", "registered", "report_buckets",
           "unregister"]
