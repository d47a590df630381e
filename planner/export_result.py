"""What every exporter returns: the config a launcher reads, and the caveats to read before launching it.

Its own module so that each exporter module (:mod:`sp_plan.planner.export_megatron`, ...) and the registry
that lists them (:mod:`sp_plan.planner.export`) import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Export:
    """An exported config plus the caveats the user should read before launching it."""

    content: dict[str, Any] | str
    notes: list[str] = field(default_factory=list)
    #: The same export as plain data for ``--json``, where ``content`` is text meant for a shell (Megatron's
    #: argument script); None: ``content`` itself.
    data: dict[str, Any] | None = None


__all__ = ["Export"]
