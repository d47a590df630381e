"""YAML parsing with libyaml's C loader when PyYAML has it (about 10x faster than the pure-Python
loader: the presets, GPU table and fabrics are parsed on every CLI start), same safe semantics."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import CostModelError, explain_validation_error

M = TypeVar("M", bound=BaseModel)

#: The file name that means standard input (where a file is read) or standard output (where one is written).
STDIO = "-"

try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]


class NumberTooLong(yaml.YAMLError):
    """A YAML number longer than Python converts (``sys.get_int_max_str_digits()``, 4,300 digits): int()
    raises ValueError from inside the loader, which every reader's ``except yaml.YAMLError`` would miss."""


def _too_long(exc: ValueError) -> bool:
    return "integer string conversion" in str(exc)


def too_long_message() -> str:
    return f"it holds a number of more than {sys.get_int_max_str_digits():,} digits, which no setting needs"


def safe_load(text: str) -> Any:
    """``yaml.safe_load``: plain data only (no arbitrary objects), with the fastest loader available."""
    try:
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader
    except ValueError as exc:
        if _too_long(exc):
            raise NumberTooLong(too_long_message()) from None
        raise


def read_small_text(path: str | Path, max_bytes: int, what: str, missing: str,
                    error: type[CostModelError] = CostModelError) -> str:
    """The text of a user-given file, refused in one line (as ``error``) when it is missing (``missing``
    completes the sentence: what is wrong and what to give instead), too large or not text. ``-`` is
    standard input (``sp-plan plan --out - | sp-plan export - --to deepspeed``)."""
    if str(path) == STDIO:
        data = sys.stdin.buffer.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise error(f"{what} on standard input is larger than {max_bytes / (1 << 20):g} MiB, which no {what} is")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{what} on standard input is not UTF-8 text: {exc}") from exc
    path = Path(path).expanduser()
    if not path.is_file():
        raise error(f"{what} {str(path)!r} {missing}")
    if path.stat().st_size > max_bytes:
        raise error(f"{what} {path} is larger than {max_bytes / (1 << 20):g} MiB, which no {what} is")
    try:
        return path.read_text()
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not a text file: {exc}") from exc


def parse_mapping(text: str, what: str, expect: str) -> dict[str, Any]:
    """YAML text that must hold a mapping (``expect`` names its keys in the error), with one-line errors."""
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise CostModelError(f"{what} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise CostModelError(f"{what} must be a YAML mapping with {expect}")
    return data


def validated(model: type[M], data: Any, what: str) -> M:
    """``model`` validated from parsed data, pydantic's report turned into one actionable line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise explain_validation_error(exc, what) from exc
