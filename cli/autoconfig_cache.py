"""A disk cache of the configs transformers completes, so a CLI call on a config.json stays fast.

Completing a config.json through ``AutoConfig.for_model`` (:mod:`sp_plan.cli.autoconfig`) imports
transformers, and with it torch and DTensor: 3-6 s of CPU in every ``sp-plan plan/estimate/validate/train
--model config.json`` process, against ~0.3 s for the plan itself. The completion is a pure function of
the file's content, the transformers release and sp-plan's own reading of the class, so its result is kept
on disk under that key and read back (one small JSON file) on the next call.

Exactness: a result is stored as its Python literal (``repr``; JSON would turn ``id2label``'s int keys
into strings) and only when reading that literal back gives an equal dict, so a hit returns what the class
would have; a file that cannot be read or parsed is a miss. The key covers the config
(sorted JSON), the transformers version and the source of the two modules that turn the class into a dict,
so an upgrade of either misses. The cache is an optimisation only: an unwritable or absent directory is
skipped without a word.

Where: ``$SP_PLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/sp-plan``, else ``~/.cache/sp-plan``, in
``autoconfig/``. ``SP_PLAN_CACHE_DIR=off`` (or ``0``/``none``) turns it off.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from sp_plan.cost_models import hf_config
from sp_plan.cost_models.atomic_io import atomic_write_text

#: The cache's own format: bump when what is stored changes meaning.
FORMAT = 1
DISABLED = {"off", "0", "none", "false", "no"}


def cache_dir() -> Path | None:
    """The folder the completed configs live in, or None when the user turned the cache off."""
    chosen = os.environ.get("SP_PLAN_CACHE_DIR")
    if chosen is not None and chosen.strip().lower() in DISABLED:
        return None
    if chosen:
        root = Path(chosen).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "sp-plan"
    return root / "autoconfig"


def transformers_version() -> str | None:
    """The installed transformers release, or None when ``import transformers`` would fail, found without
    importing it (that import is what the cache saves)."""
    if "transformers" in sys.modules:
        module = sys.modules["transformers"]
        return getattr(module, "__version__", None) if module is not None else None
    try:
        if importlib.util.find_spec("transformers") is None:
            return None
        return importlib.metadata.version("transformers")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


@functools.cache
def _reader_fingerprint() -> str:
    """A digest of the code that turns a config class into the dict we plan from: a change to it misses."""
    digest = hashlib.sha256()
    for path in (Path(hf_config.__file__), Path(__file__).with_name("autoconfig.py")):
        with contextlib.suppress(OSError):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(config: dict[str, Any], version: str) -> str | None:
    """The file name of ``config``'s completion under transformers ``version``; None for a config that is
    not plain JSON (then nothing is cached)."""
    try:
        text = json.dumps(config, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None
    payload = json.dumps([FORMAT, version, _reader_fingerprint(), text])
    return hashlib.sha256(payload.encode()).hexdigest() + ".repr"


def load(key: str) -> dict[str, Any] | None:
    """A stored completion, or None (absent, unreadable, not a dict literal)."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        value = ast.literal_eval((folder / key).read_text())
    except (OSError, ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def store(key: str, completed: dict[str, Any]) -> None:
    """Keep ``completed`` under ``key`` if its literal reads back equal; silently skip otherwise (a value
    with no literal form, a NaN) or when the folder cannot be written."""
    folder = cache_dir()
    if folder is None:
        return
    text = repr(completed)
    try:
        if ast.literal_eval(text) != completed:
            return
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return
    with contextlib.suppress(Exception):  # noqa: BLE001 - an optimisation: any failure just means no cache
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / key, text)


__all__ = ["cache_dir", "cache_key", "load", "store", "transformers_version"]
