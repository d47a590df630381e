"""The memory-option lattice the planner searches for each layout.

Every option trades time for memory: more ZeRO sharding, more recompute, offloading, tiling, smaller
micro-batches. Each axis lists its values from fastest to most memory-saving, which makes the set of
option combinations a lattice with two monotone properties the search relies on (and documents):

* memory never grows when one axis moves up, so if a combination does not fit, nothing below it does;
* step time never shrinks when one axis moves up, so once a combination fits, nothing above it can be
  faster.

The minimal fitting combinations (the lattice's frontier) are therefore the only candidates worth
timing. Options the user fixed on the command line become one-value axes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sp_plan.cost_models.train_spec import TrainSpec

#: Largest micro-batch the planner tries; long-context runs are memory-bound long before this.
MAX_MICRO_BATCH = 8
#: Micro-batches above 1 are tried only while a micro-batch stays at or under this many tokens:
#: beyond it every matmul is already large enough to run at full efficiency, so a bigger micro-batch
#: only costs memory.
MAX_MICRO_BATCH_TOKENS = 1 << 16

#: Axes in training mode, each from fastest to most memory-saving.
#: ZeRO: 2 and 3 only, the two modes FSDP2 runs (reshard_after_forward False / True); ZeRO-0/1 need a
#: different engine and save less memory for the same traffic, so the search does not propose them
#: (the user may still pin them with --zero).
TRAIN_AXES: dict[str, tuple[Any, ...]] = {
    "zero_stage": (2, 3),
    "checkpointing": ("none", "selective", "full"),
    "offload_checkpoints": (False, True),
    "tiled_loss": (False, True),
    "tiled_mlp": (False, True),
    "offload_optimizer": (False, True),
    "offload_params": (False, True),
}
#: Prefill keeps no gradients or optimizer: weights are replicated (0) or sharded (3), the FFN may be
#: tiled, and parameter shards may live in host memory.
PREFILL_AXES: dict[str, tuple[Any, ...]] = {
    "zero_stage": (0, 3),
    "tiled_mlp": (False, True),
    "offload_params": (False, True),
}

#: Axes whose step-time cost is small next to recompute or offloaded optimizer steps. The search
#: first asks whether maxing them out can make a combination fit; if not, it skips every combination
#: that differs only in them (memory is monotone, so none of those can fit either).
CHEAP_AXES = frozenset({"zero_stage", "offload_checkpoints", "tiled_loss", "tiled_mlp"})

#: Options that add a mechanism (a "moving part") to the run, for the near-tie preference.
MOVING_PART_OPTIONS = ("offload_checkpoints", "tiled_loss", "tiled_mlp", "offload_optimizer", "offload_params")


@dataclass(frozen=True)
class Axis:
    name: str
    values: tuple[Any, ...]


Combo = tuple[int, ...]  # one index per axis


@dataclass(frozen=True)
class OptionLattice:
    axes: tuple[Axis, ...]

    @property
    def bottom(self) -> Combo:
        return tuple(0 for _ in self.axes)

    @property
    def top(self) -> Combo:
        return tuple(len(a.values) - 1 for a in self.axes)

    def values(self, combo: Combo) -> dict[str, Any]:
        return {axis.name: axis.values[i] for axis, i in zip(self.axes, combo)}

    def successors(self, combo: Combo) -> Iterator[Combo]:
        for k, axis in enumerate(self.axes):
            if combo[k] + 1 < len(axis.values):
                yield combo[:k] + (combo[k] + 1,) + combo[k + 1:]

    def index(self, name: str) -> int:
        return [a.name for a in self.axes].index(name)

    def repair_down(self, combo: Combo, keep: int | None = None) -> Combo:
        """The largest valid combination at or below ``combo`` that leaves axis ``keep`` unchanged:
        lowers whichever other axis makes it invalid."""
        out = list(combo)
        for _ in range(len(out) + 1):
            reason = invalid_reason(self.values(tuple(out)))
            if reason is None:
                return tuple(out)
            for name in _offenders(reason):
                k = self.index(name)
                if k != keep and out[k] > 0 and name != "offload_optimizer":
                    out[k] = 0
                    break
                if name == "offload_optimizer" and k != keep:
                    out[k] = len(self.axes[k].values) - 1
                    break
            else:
                return tuple(out)  # cannot repair without touching ``keep``: caller sees it invalid
        return tuple(out)

    def repair_up(self, combo: Combo) -> Combo:
        """The smallest valid combination at or above ``combo``: raises what an enabled option needs."""
        out = list(combo)
        values = self.values(tuple(out))
        if values.get("offload_params"):
            out[self.index("zero_stage")] = len(self.axes[self.index("zero_stage")].values) - 1
            if "offload_optimizer" in values:
                out[self.index("offload_optimizer")] = len(self.axes[self.index("offload_optimizer")].values) - 1
        if values.get("offload_checkpoints") and values.get("checkpointing") == "none":
            out[self.index("checkpointing")] = 1
        return tuple(out)

    def cheap_closure(self, combo: Combo) -> Combo:
        """``combo`` with every cheap axis at its most saving value that keeps the combination valid."""
        out = list(combo)
        for k, axis in enumerate(self.axes):
            if axis.name in CHEAP_AXES:
                out[k] = len(axis.values) - 1
                if invalid_reason(self.values(tuple(out))):  # e.g. checkpoint offload without checkpointing
                    out[k] = combo[k]
        return tuple(out)

    def expensive_successors(self, combo: Combo) -> Iterator[Combo]:
        for k, axis in enumerate(self.axes):
            if axis.name not in CHEAP_AXES and combo[k] + 1 < len(axis.values):
                yield combo[:k] + (combo[k] + 1,) + combo[k + 1:]

    def size(self) -> int:
        n = 1
        for axis in self.axes:
            n *= len(axis.values)
        return n


def invalid_reason(options: dict[str, Any]) -> str | None:
    """Combinations TrainSpec would reject, or that do nothing (kept out of the search)."""
    if options.get("offload_params") and options.get("zero_stage") != 3:
        return "parameter offload needs ZeRO-3"
    if options.get("offload_checkpoints") and options.get("checkpointing") == "none":
        return "checkpoint offload needs checkpointing"
    if options.get("offload_params") and options.get("offload_optimizer") is False:
        # FSDP2's CPU offload moves parameters, gradients and optimizer states together; the
        # combination without optimizer offload is the same run under another name.
        return "parameter offload already offloads the optimizer"
    return None


#: Values under which no other option is invalid: the completion of a partial set of pins.
_PERMISSIVE = {"zero_stage": 3, "checkpointing": "full", "offload_optimizer": True}


def conflicting_pins(fixed: dict[str, Any]) -> str | None:
    """Why options the user pinned can never go together (e.g. parameter offload with ZeRO-2), judged on
    the pins alone: unpinned options may take whatever value makes them valid."""
    return invalid_reason({**_PERMISSIVE, **fixed})


def _offenders(reason: str) -> tuple[str, ...]:
    """Axes that can be lowered (or, for the optimizer, raised) to fix an invalid combination."""
    if "ZeRO-3" in reason:
        return ("offload_params",)
    if "checkpoint offload" in reason:
        return ("offload_checkpoints",)
    return ("offload_optimizer", "offload_params")


def micro_batch_values(sequences_per_rank: int, seq_len: int) -> tuple[int, ...]:
    """Micro-batches that divide a data-parallel rank's sequences per step, largest (fastest) first,
    limited to ``MAX_MICRO_BATCH_TOKENS`` tokens per micro-batch (1 is always allowed)."""
    cap = max(1, min(MAX_MICRO_BATCH, sequences_per_rank, MAX_MICRO_BATCH_TOKENS // seq_len))
    sizes = [m for m in range(1, cap + 1) if sequences_per_rank % m == 0]
    return tuple(sorted(sizes, reverse=True))


def build_lattice(base: TrainSpec, fixed: dict[str, Any], sequences_per_rank: int,
                  micro_batch_fixed: bool, stack_options: dict[str, tuple[Any, ...]] | None = None) -> OptionLattice:
    """The lattice for one layout: searchable axes, with the user's fixed choices as one-value axes.

    ``stack_options`` (training only): the values the stack can run per option
    (:class:`sp_plan.cost_models.stack.StackSearch`), which replace the axis' default values; a pin wins,
    and is checked against them by the search before it gets here."""
    table = TRAIN_AXES if base.is_training else PREFILL_AXES
    if base.is_training and stack_options:
        table = {name: stack_options.get(name, values) for name, values in table.items()}
    axes = [Axis(name, (fixed[name],) if name in fixed else values) for name, values in table.items()]
    if micro_batch_fixed:
        axes.append(Axis("micro_batch", (base.micro_batch,)))
    else:
        axes.append(Axis("micro_batch", micro_batch_values(sequences_per_rank, base.seq_len)))
    return OptionLattice(tuple(axes))


def moving_parts(options: dict[str, Any]) -> int:
    """How many optional mechanisms a combination switches on (selective checkpointing counts: it
    needs a custom recompute policy)."""
    return sum(bool(options.get(k)) for k in MOVING_PART_OPTIONS) + (options.get("checkpointing") == "selective")
