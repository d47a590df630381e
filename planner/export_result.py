"""What every exporter returns: the config a launcher reads, and the caveats to read before launching it.

Its own module so that each exporter module (:mod:`sp_plan.planner.export_megatron`, ...) and the registry
that lists them (:mod:`sp_plan.planner.export`) import it without importing each other.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from .errors import PlannerError


@dataclass
class Export:
    """An exported config plus the caveats the user should read before launching it."""

    content: dict[str, Any] | str
    notes: list[str] = field(default_factory=list)
    #: The same export as plain data for ``--json``, where ``content`` is text meant for a shell (Megatron's
    #: argument script); None: ``content`` itself.
    data: dict[str, Any] | None = None


def shell_word(value: str, what: str) -> str:
    """``value`` as one literal shell word (:func:`shlex.quote`): newlines, ``$(...)``, backticks and quotes
    stay text. A NUL byte cannot be part of any command-line argument, so it is refused."""
    if "\0" in value:
        raise PlannerError(f"{what} {value.replace(chr(0), '?')!r} contains a NUL byte, which no command line can "
                           "carry; rename it without control characters")
    return shlex.quote(value)


def one_line_shell_word(value: str, what: str) -> str:
    """:func:`shell_word`, but on one line whatever ``value`` holds: a command quoted inside a one-line error
    message (a model name with a newline would split it). Control characters are written in bash's
    ``$'...'`` quoting, which reads them back as the same characters."""
    word = shell_word(value, what)
    if value.isprintable():
        return word
    escapes = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    body = "".join(escapes.get(ch) or (ch if ch.isprintable() else
                                       f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
                                       if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}") for ch in value)
    return f"$'{body}'"


def comment_text(text: str) -> str:
    """``text`` safe inside a one-line ``#`` shell comment: line breaks and other control characters (which would
    end the comment and start a command) are written as escapes."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


__all__ = ["Export", "comment_text", "one_line_shell_word", "shell_word"]
