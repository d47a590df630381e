"""How the world of GPUs is factored: dp_replicate x dp_shard x ring x ulysses x tp.

Mesh order, outermost to innermost, is ``dp_replicate, dp_shard, ring, ulysses, tp``: innermost
dimensions are contiguous in rank order, so they land on the fastest links (NVLink) when ranks are
numbered node by node.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from .errors import CostModelError
from .model_spec import ModelSpec

MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "ring", "ulysses", "tp")

#: Bound on any one degree and on the world size: far above any cluster, low enough to stay sane.
MAX_DEGREE = 1 << 20


class Layout(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    dp_replicate: int = Field(default=1, ge=1, le=MAX_DEGREE)
    dp_shard: int = Field(default=1, ge=1, le=MAX_DEGREE)
    tp: int = Field(default=1, ge=1, le=MAX_DEGREE)
    ulysses: int = Field(default=1, ge=1, le=MAX_DEGREE)
    ring: int = Field(default=1, ge=1, le=MAX_DEGREE)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.ulysses * self.ring

    @property
    def sp(self) -> int:
        """Sequence-parallel degree: ranks that split one sequence (Ulysses x Ring)."""
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks across which ZeRO/FSDP shards parameters, grads and optimizer states.

        They hold the same TP shard of the weights and the same model replica: the data-parallel
        shard dim plus both sequence-parallel dims (SP ranks compute gradients of the same weights).
        """
        return self.dp_shard * self.ulysses * self.ring

    @property
    def head_split(self) -> int:
        """Ways the attention heads are split: TP splits them, and so does Ulysses' all-to-all."""
        return self.tp * self.ulysses

    def seq_multiple(self, tp_splits_sequence: bool = True) -> int:
        """The sequence length must be a multiple of this.

        Ulysses x Ring split the sequence; zigzag ring attention cuts it into 2 x ring chunks; with
        Megatron sequence parallelism TP splits the local sequence again between attention blocks.
        """
        tp = self.tp if tp_splits_sequence else 1
        return self.ulysses * self.ring * (2 if self.ring > 1 else 1) * tp

    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def describe(self) -> str:
        """Compact form listing only degrees above 1, e.g. ``ulysses=8`` or ``dp_shard=2 x ring=4``."""
        parts = [f"{dim}={deg}" for dim, deg in self.degrees().items() if deg > 1]
        return " x ".join(parts) or "single GPU"

    @classmethod
    def for_world(cls, world: int, **degrees: int | None) -> "Layout":
        """Fill ``dp_shard`` so the product equals ``world`` when it was not given.

        The CLI lets users name only the interesting degrees; the rest of the GPUs become data-parallel
        shards, the standard FSDP default.
        """
        if world < 1 or world > MAX_DEGREE:
            raise CostModelError(f"GPU count {world} is out of range: use 1 .. {MAX_DEGREE}")
        given = {k: v for k, v in degrees.items() if v is not None}
        for name, value in given.items():
            if name not in MESH_DIMS:
                raise CostModelError(f"unknown layout dimension {name!r}; use {', '.join(MESH_DIMS)}")
            if value < 1:
                raise CostModelError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if "dp_shard" not in given:
            others = math.prod(v for k, v in given.items())
            if world % others:
                raise CostModelError(
                    f"{world} GPUs cannot be split as {_product_text(given)} = {others}: "
                    f"the product of the layout degrees must divide the GPU count"
                )
            given["dp_shard"] = world // others
        layout = cls(**given)
        if layout.world != world:
            raise CostModelError(
                f"layout {layout.describe()} uses {layout.world} GPUs but --gpus is {world}: "
                "make dp_replicate x dp_shard x tp x ulysses x ring equal the GPU count"
            )
        return layout

    def check_against(self, model: ModelSpec, seq_len: int, tp_splits_sequence: bool = True) -> None:
        """Raise a one-line actionable error if this layout cannot run ``model`` at ``seq_len``."""
        heads = model.num_heads
        if heads % self.head_split:
            valid = ", ".join(str(d) for d in model.valid_head_split_degrees())
            if self.tp == 1:
                raise CostModelError(
                    f"ulysses={self.ulysses} does not divide {heads} query heads; valid Ulysses degrees for "
                    f"this model: {valid}, or move the extra degree to ring"
                )
            raise CostModelError(
                f"tp x ulysses = {self.tp} x {self.ulysses} = {self.head_split} does not divide {heads} query "
                f"heads; tp x ulysses must be one of {valid} (move the extra degree to ring or dp)"
            )
        model.kv_replication(self.head_split)  # raises when KV heads neither divide nor replicate
        multiple = self.seq_multiple(tp_splits_sequence)
        if seq_len % multiple:
            lower = seq_len - seq_len % multiple
            upper = lower + multiple
            why = f"ulysses x ring = {self.sp}" + (" x 2 (zigzag ring)" if self.ring > 1 else "")
            if tp_splits_sequence and self.tp > 1:
                why += f" x tp = {self.tp} (Megatron sequence parallelism)"
            suggestion = f"{lower} or {upper}" if lower else f"{upper}"
            raise CostModelError(
                f"sequence length {seq_len} is not divisible by {why} = {multiple}; use {suggestion} "
                "(or pad the data to that multiple)"
            )


def _product_text(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items()) or "1"
