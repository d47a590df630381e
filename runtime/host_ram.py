"""Host RAM a run needs before it can shard anything: every rank builds the whole model in fp32 first.

Torch-free, so the CLI can check a plan (``sp-plan validate``) before it launches any rank, and the training
entry point (``sp-plan train --plan``) before it builds the model: a rank the kernel kills for memory leaves
only a bare SIGKILL behind.
"""

from __future__ import annotations

from pathlib import Path

#: Bytes per parameter of the model every rank builds (seeded random fp32 weights) before it is sharded.
INIT_BYTES_PER_PARAM = 4


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


__all__ = ["INIT_BYTES_PER_PARAM", "available_host_bytes"]
