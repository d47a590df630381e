"""The shipped data files, and the one rule that tells a shipped name from a user's file.

Every YAML file the package ships lives in a folder of this package, one file per entity:

- ``models/<name>.yaml``: transformer architectures (:mod:`sp_plan.cost_models.model_spec`);
- ``gpus/<name>.yaml``: accelerator variants (:mod:`sp_plan.cost_models.gpu_spec`);
- ``kernels/<family>.yaml``: kernel-model priors per GPU family (:mod:`sp_plan.cost_models.kernels`);
- ``stacks/<name>.yaml``: software-stack profiles (:mod:`sp_plan.cost_models.stack`);
- ``topologies/<name>.yaml``: node presets, plus ``_fabrics.yaml`` (:mod:`sp_plan.cost_models.topology`);
- ``calibration/<name>.yaml``: published measurements and the values fitted to them;
- ``lengths/<name>.yaml``: document-length distributions (:mod:`sp_plan.cost_models.lengths`).

A new model, GPU, stack or topology is one new file: nothing else lists them. A model, GPU or stack file may
declare other names of the same entity (``aliases: [...]``); they resolve to the file's name, which is
what plans print. Files whose name starts with ``_`` are helpers, not entities.

This module is the only one that opens the package's data (``importlib.resources``), and the only one
that decides whether a reference names a shipped entity or a user's file (:func:`resolve`):

1. a reference with a path separator or the kind's file suffix (``.json`` for models, ``.yaml``/``.yml``
   for stacks and topologies, ``.json``/``.csv`` for length distributions) is a user's file;
2. otherwise a shipped name or alias, case-insensitive, is that entity;
3. otherwise an existing file or folder is a user's file;
4. anything else is an unknown name, refused with the closest names.

A user's file is read at most :data:`MAX_USER_FILE_BYTES` and must be UTF-8 text (:func:`read_user_text`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CostModelError
from ..yaml_io import safe_load

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

#: Largest user file (model config.json, stack or topology YAML) read: real ones are a few KB, so a larger
#: file is not one of them, and is refused before it is read.
MAX_USER_FILE_BYTES = 1 << 20
#: Suffix of every shipped data file.
SUFFIX = ".yaml"


@dataclass(frozen=True)
class Kind:
    """One folder of shipped data and how its entities are named in messages."""

    #: What one entity is called: "unknown {what} 'x'".
    what: str
    #: What a user's file of this kind is called ("stack file '/x.yaml' not found"); None: the kind takes
    #: shipped names only.
    user_file: str | None = None
    #: Suffixes that mark a reference as a user's file.
    suffixes: tuple[str, ...] = ()
    #: How the unknown-name error offers a user's file ("... or give a YAML file").
    give: str = ""
    #: Whether the entity files may declare other names (``aliases: [...]``).
    aliased: bool = False


KINDS: dict[str, Kind] = {
    "models": Kind("model", "model config", (".json",), "a path to a config.json (or a folder holding one)",
                   aliased=True),
    "gpus": Kind("GPU", aliased=True),
    "kernels": Kind("kernel file"),
    "stacks": Kind("stack", "stack file", (".yaml", ".yml"), "a stack YAML file", aliased=True),
    "topologies": Kind("topology", "topology file", (".yaml", ".yml"), "a path to a topology YAML file"),
    "calibration": Kind("calibration data file"),
    "lengths": Kind("lengths preset", "lengths file", (".json", ".csv"),
                    "a lengths JSON written by `sp-plan lengths` or a CSV with header length,count"),
}


@dataclass(frozen=True)
class Resolved:
    """What a reference names: a shipped entity (``name``, canonical) or a user's file (``path``)."""

    kind: str
    name: str | None = None
    path: Path | None = None

    @property
    def shipped(self) -> bool:
        return self.name is not None


def _kind(kind: str) -> Kind:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"no data kind {kind!r}: one of {', '.join(KINDS)}") from None


def _folder(kind: str) -> Traversable:
    _kind(kind)
    return resources.files(__name__).joinpath(kind)


@cache
def names(kind: str) -> tuple[str, ...]:
    """The shipped entities of a kind, by name, sorted (helper files, named ``_*``, are not entities)."""
    return tuple(sorted(
        entry.name.removesuffix(SUFFIX)
        for entry in _folder(kind).iterdir()
        if entry.name.endswith(SUFFIX) and not entry.name.startswith("_")
    ))


def shipped_file(kind: str, name: str) -> Traversable:
    """The shipped file ``<kind>/<name>.yaml`` (which may not exist: see ``is_file()``)."""
    return _folder(kind).joinpath(f"{name}{SUFFIX}")


def read_text(kind: str, name: str) -> str:
    """The text of a shipped file by its exact name (an entity or a ``_*`` helper); an unknown name is
    refused with the closest ones."""
    entry = shipped_file(kind, name)
    if not entry.is_file():
        raise unknown_name(kind, name)
    return entry.read_text(encoding="utf-8")


@cache
def load(kind: str, name: str) -> dict:
    """A shipped file parsed. Cached and shared by every caller (presets are asked for on every
    evaluation), so read it, never change it."""
    data = safe_load(read_text(kind, name))
    if not isinstance(data, dict):
        raise CostModelError(f"shipped {_kind(kind).what} file {kind}/{name}{SUFFIX} must be a YAML mapping")
    return data


@cache
def aliases(kind: str) -> dict[str, str]:
    """Other names -> shipped name, as the entity files of a kind declare them (``aliases: [...]``)."""
    table: dict[str, str] = {}
    if not _kind(kind).aliased:
        return table
    for name in names(kind):
        for alias in load(kind, name).get("aliases") or ():
            key = str(alias).strip().lower()
            if key in table or key in names(kind):
                raise CostModelError(f"shipped {_kind(kind).what} alias {key!r} of {name} is already a name or an "
                                     "alias of another file: each name must mean one file")
            table[key] = name
    return table


def canonical(kind: str, ref: str) -> str | None:
    """The shipped name a name or alias means (case-insensitive), or None when nothing shipped has it."""
    key = str(ref).strip().lower()
    key = aliases(kind).get(key, key)
    return key if key in names(kind) else None


def unknown_name(kind: str, ref: str) -> CostModelError:
    """The error for a name nothing shipped has: the closest names, the list, and what else to give."""
    spec = _kind(kind)
    key = str(ref).strip().lower()
    candidates = [*names(kind), *aliases(kind)]
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    alternative = f" or give {spec.give}" if spec.give else ""
    return CostModelError(f"unknown {spec.what} {ref!r}: {hint}choose one of {', '.join(names(kind))}{alternative}")


def _looks_like_path(spec: Kind, text: str) -> bool:
    return "/" in text or Path(text).suffix.lower() in spec.suffixes


def resolve(kind: str, ref: str | Path) -> Resolved:
    """A shipped entity or a user's file, by the module's one rule (see the module docstring); an unknown
    name is refused with the closest shipped names."""
    spec = _kind(kind)
    text = str(ref).strip()
    if spec.user_file is not None and _looks_like_path(spec, text):
        return Resolved(kind, path=Path(text).expanduser())
    name = canonical(kind, text)
    if name is not None:
        return Resolved(kind, name=name)
    if spec.user_file is not None and text and Path(text).expanduser().exists():
        return Resolved(kind, path=Path(text).expanduser())
    raise unknown_name(kind, text)


def is_user_file(kind: str, ref: str | Path) -> bool:
    """Whether :func:`resolve` reads ``ref`` as a user's file (False also for unknown names)."""
    try:
        return not resolve(kind, ref).shipped
    except CostModelError:
        return False


def read_user_text(kind: str, path: str | Path) -> str:
    """The text of a user's file of a kind, refused in one line when it is missing, larger than
    :data:`MAX_USER_FILE_BYTES`, or not UTF-8 text."""
    spec = _kind(kind)
    what = spec.user_file or spec.what
    path = Path(path).expanduser()
    if not path.is_file():
        shipped = ", ".join(names(kind))
        raise CostModelError(f"{what} {str(path)!r} not found: the file does not exist; give an existing path or a "
                             f"shipped {spec.what} ({shipped})")
    if path.stat().st_size > MAX_USER_FILE_BYTES:
        raise CostModelError(f"{what} {path} is larger than {MAX_USER_FILE_BYTES >> 20} MiB, which no {what} is")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CostModelError(f"{what} {path} is not a UTF-8 text file: {exc.reason} at byte {exc.start}") from exc
    except OSError as exc:
        raise CostModelError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


__all__ = [
    "KINDS",
    "MAX_USER_FILE_BYTES",
    "Kind",
    "Resolved",
    "aliases",
    "canonical",
    "is_user_file",
    "load",
    "names",
    "read_text",
    "read_user_text",
    "resolve",
    "shipped_file",
    "unknown_name",
]
