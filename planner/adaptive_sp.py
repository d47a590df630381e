"""A length-adaptive sequence-parallel plan: rows of different length buckets run with different SP degrees in
one job (ByteScale, FlexSP), long rows on a large Ulysses/Ring group, short rows on small groups side by side.

This module holds the plan's shape only, shared by the planner that chooses it and the runtime that runs it
(the runtime imports it; it imports neither torch nor the search). A step runs the buckets one after another,
every rank taking part in each: bucket ``b`` splits the world into ``world / (ulysses x ring)`` data-parallel
groups of ``ulysses x ring`` ranks, each group processing its share of the bucket's rows, so the bucket's time is
its slowest group's and the step's is the sum over buckets. Gradients of all buckets are summed and reduced once,
over the whole world, weighted by token count: the step's loss is the mean over every loss token of the global
batch, whatever bucket its row was in (exactly what one process computes on the same rows).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LengthBucket(BaseModel):
    """Documents up to ``max_document_tokens`` tokens (and longer than the previous bucket's bound), packed into
    rows of ``row_tokens``, run on SP groups of ``ulysses x ring`` ranks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_document_tokens: int = Field(ge=1)
    row_tokens: int = Field(ge=1)
    ulysses: int = Field(default=1, ge=1)
    ring: int = Field(default=1, ge=1)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    def data_parallel(self, world: int) -> int:
        """Groups side by side in this bucket: each takes its own rows."""
        return world // self.sp


class AdaptiveSPPlan(BaseModel):
    """Buckets in increasing document length; every bucket's SP degree divides ``world``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = "sp-plan-adaptive-sp"
    version: int = 1
    world: int = Field(ge=1)
    buckets: list[LengthBucket] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> AdaptiveSPPlan:
        bounds = [b.max_document_tokens for b in self.buckets]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"bucket bounds {bounds} must increase strictly")
        for b in self.buckets:
            if self.world % b.sp:
                raise ValueError(f"bucket up to {b.max_document_tokens} tokens: ulysses x ring = {b.sp} does not "
                                 f"divide the {self.world} ranks")
            if b.row_tokens % (2 * b.ring):
                raise ValueError(f"bucket up to {b.max_document_tokens} tokens: rows of {b.row_tokens} tokens do not "
                                 f"split into 2 x ring = {2 * b.ring} zigzag chunks")
        return self

    def bucket_for(self, document_tokens: int) -> int:
        """Index of the bucket a document of this length goes to (the last bucket takes longer ones, split)."""
        for i, b in enumerate(self.buckets):
            if document_tokens <= b.max_document_tokens:
                return i
        return len(self.buckets) - 1


__all__ = ["AdaptiveSPPlan", "LengthBucket"]
