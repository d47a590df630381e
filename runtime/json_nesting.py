"""Refuse a JSON/JSON-lines data file nested deeper than any dataset is, before pyarrow reads it.

``datasets`` reads ``.json``/``.jsonl`` files with pyarrow's JSON reader, which recurses per nesting level
in native code: a line of 20,000 ``[`` kills the process with SIGSEGV (pyarrow 2x; 10,000 still parses), so
``sp-plan train --dataset`` ended in "Segmentation fault" with no message. A text dataset's records nest a
handful of levels (a chat transcript: about six); :data:`MAX_JSON_DEPTH` is far above that and far below
the crash. The scan strips string literals (a raw newline cannot occur inside one, so line-aligned blocks
keep every string whole) and counts the brackets left: a few seconds per GB, paid only when a dataset is
packed (the packing is cached).
"""

from __future__ import annotations

import re
from pathlib import Path

#: Deepest nesting a data file may have: records of real datasets nest under ten levels.
MAX_JSON_DEPTH = 512
#: Bytes read at a time (cut back to the last newline).
BLOCK_BYTES = 1 << 24

_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_OPENERS = bytes(b for b in range(256) if b not in b"[{\n")


def _openers_per_line_within(data: bytes, limit: int) -> bool:
    """Whether no line of ``data`` holds more than ``limit`` opening brackets (strings included): then no
    JSON-lines record in it nests deeper, and the exact scan is not needed (the common case, at C speed)."""
    kept = data.translate(None, _NOT_OPENERS)
    return len(kept) <= limit or max(map(len, kept.split(b"\n"))) <= limit


def nesting_beyond(path: str | Path, limit: int = MAX_JSON_DEPTH) -> int | None:
    """The bracket depth (strings ignored) at which the JSON text in ``path`` first nests deeper than
    ``limit`` (the scan stops there), or None when it never does. A ``.jsonl`` file's lines are records
    (each starts at depth 0), so a block whose lines each hold at most ``limit`` openers is skipped without
    the exact count; a ``.json`` file is one document and is always counted exactly."""
    import numpy as np

    lines_are_records = Path(path).suffix.lower() == ".jsonl"
    depth = 0
    carry = b""
    with open(path, "rb") as handle:
        while True:
            block = handle.read(BLOCK_BYTES)
            data = carry + block
            if block:
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) < 4 * BLOCK_BYTES:  # no line end yet: read on (bounded)
                    carry = data
                    continue
                data, carry = (data[:cut], data[cut:]) if cut else (data, b"")
            if lines_are_records and _openers_per_line_within(data, limit):
                depth = 0
                if not block:
                    return None
                continue
            brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
            if brackets:
                raw = np.frombuffer(brackets, dtype=np.uint8)
                steps = np.where((raw == ord("[")) | (raw == ord("{")), 1, -1)
                levels = depth + np.cumsum(steps)
                deepest = int(levels.max())
                if deepest > limit:
                    return deepest
                depth = max(0, int(levels[-1]))
            if not block:
                return None


def check_json_nesting(paths, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise a one-line :class:`RuntimeConfigError` for the first file in ``paths`` nested over ``limit``."""
    from sp_plan.runtime.errors import RuntimeConfigError

    for path in paths:
        depth = nesting_beyond(path, limit)
        if depth is not None:
            raise RuntimeConfigError(
                f"dataset file {path} nests JSON more than {limit} levels deep (level {depth} reached): no text "
                "dataset does, and pyarrow's JSON reader crashes on it; fix or remove the file"
            )


__all__ = ["BLOCK_BYTES", "MAX_JSON_DEPTH", "check_json_nesting", "nesting_beyond"]
