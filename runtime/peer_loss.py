"""A collective that failed because another rank is gone: one line instead of the backend's traceback.

When a rank is killed (the OOM killer, a preempted node, a user's ``kill -9``), every surviving rank's next
collective fails inside gloo or NCCL with a RuntimeError (``DistBackendError``) whose traceback runs through
the trainer and the backend and ends in "Connection closed by peer ... GLHF!". Under torchrun the launcher
notices the dead rank a moment later and stops the others, so the user's terminal showed the survivors'
tracebacks above the launcher's report. The CLI prints this line instead (:func:`peer_lost_line`); the dead
rank's own message, or the launcher's "rank N was killed by SIGKILL", says why it is gone. Torch-free:
the check reads only the exception's text.
"""

from __future__ import annotations

import os
import re

#: What gloo and NCCL say when the process at the other end of a connection is gone.
PEER_LOST_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "caused pair closure",
    "NCCL communicator was aborted", "remote process exited or there was a network error",
)


def peer_lost_detail(exc: BaseException) -> str | None:
    """The backend's own phrase (with the peer's address) when ``exc`` or an exception it was raised from
    reports a lost peer; None otherwise."""
    current: BaseException | None = exc
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        for marker in PEER_LOST_MARKERS:
            at = text.find(marker)
            if at >= 0:
                phrase = re.split(r"\.(?:\s|$)", text[at:], maxsplit=1)[0]
                return phrase.strip()[:200]
        current = current.__cause__ or current.__context__
    return None


def peer_lost_line(exc: BaseException) -> str | None:
    """``rank R lost its connection to another rank ...`` for a lost-peer failure, else None."""
    detail = peer_lost_detail(exc)
    if detail is None:
        return None
    rank = os.environ.get("RANK")
    who = f"rank {rank}" if rank is not None else "this process"
    return (f"{who} lost its connection to another rank in a collective ({detail}): that rank stopped (killed, "
            "out of memory, or its own error, printed by it or reported by the launcher); this one stops too")


__all__ = ["PEER_LOST_MARKERS", "peer_lost_detail", "peer_lost_line"]
