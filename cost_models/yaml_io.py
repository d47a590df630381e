"""YAML parsing with libyaml's C loader when PyYAML has it (about 10x faster than the pure-Python
loader: the presets, GPU table and fabrics are parsed on every CLI start), same safe semantics."""

from __future__ import annotations

from typing import Any

import yaml

try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]


def safe_load(text: str) -> Any:
    """``yaml.safe_load``: plain data only (no arbitrary objects), with the fastest loader available."""
    return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a SafeLoader
