"""Units and their parsing/printing.

Inside the code everything is bytes, seconds, FLOPs and FLOP/s. Humans type sequence lengths as
``128K`` or ``1M`` (K = 1024, M = 1024**2, as the long-context literature counts) and read tables in
GB (1e9 bytes) or GiB (2**30 bytes), always labelled.
"""

from __future__ import annotations

import re
from decimal import Decimal

from .errors import CostModelError

GB = 1_000_000_000
GiB = 1 << 30
MiB = 1 << 20

#: Longest sequence we accept: 2**30 tokens (about 1.07 billion). Far beyond any published run, and
#: small enough that every derived quantity stays a sane float; larger is almost certainly a typo.
MAX_SEQ_LEN = 1 << 30

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SEQ_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)\s*$", re.IGNORECASE)


def parse_token_count(text: str | int, what: str = "sequence length", maximum: int = MAX_SEQ_LEN) -> int:
    """Parse ``32K``/``1M``/``1000000`` into a token count (``what`` names it in errors), rejecting nonsense
    with a clear error. Every token count on the command line goes through here, so they all take suffixes."""
    if isinstance(text, bool):
        raise CostModelError(f"{what} must be a number of tokens, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SEQ_RE.match(str(text))
        if not match:
            raise CostModelError(
                f"cannot read {what} {text!r}: use an integer or a K/M suffix, e.g. 131072, 128K, 1M"
            )
        number, suffix = match.groups()
        # Decimal, not float: a 400-digit count would be float infinity (int() then raises OverflowError),
        # and 1.0000000000000001K would round to a whole number. The range is checked before int().
        scaled = Decimal(number) * _SUFFIX[suffix.upper()]
        if not 1 <= scaled <= maximum:
            shown = text if len(str(text)) <= 40 else f"{str(text)[:20]}... ({len(str(text))} characters)"
            raise CostModelError(f"{what} {shown!r} is out of range: use 1 .. {maximum} tokens")
        if scaled != scaled.to_integral_value():
            raise CostModelError(f"{what} {text!r} is not a whole number of tokens")
        value = int(scaled)
    if value < 1 or value > maximum:
        raise CostModelError(f"{what} {value} is out of range: use 1 .. {maximum} tokens")
    return value


def parse_seq_len(text: str | int) -> int:
    """A sequence length (at most :data:`MAX_SEQ_LEN`, 1G tokens)."""
    return parse_token_count(text, "sequence length", MAX_SEQ_LEN)


def format_tokens(n: int) -> str:
    """Short token count: exact K/M multiples get a suffix, anything else is printed in full."""
    for suffix, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return f"{n:,}"


def format_bytes(n: float, unit: str = "GB") -> str:
    """Bytes as a labelled GB or GiB figure with two decimals."""
    scale = GB if unit == "GB" else GiB
    return f"{n / scale:,.2f} {unit}"
