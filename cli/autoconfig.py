"""Model configs as transformers reads them: ``AutoConfig`` when transformers is installed.

A config.json leaves out whatever its config class defaults (LlamaConfig's ``intermediate_size``,
Mistral's ``sliding_window``, a MoE family's aliases), so reading the file alone can miss or misread a
field that transformers, and so the training run, fills in. When transformers is importable the CLI hands
the parsed file to ``AutoConfig.for_model`` (no file or network access, no remote code) and plans from
the complete config; without transformers, or for a ``model_type`` it does not know, the file is read as
written and the cost models' own table (:mod:`sp_plan.cost_models.hf_config`) supplies the defaults it
knows or refuses with what is missing. transformers is imported here, in the CLI layer, and only when a
config file or hub id is given: the cost models never import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sp_plan.cli import autoconfig_cache
from sp_plan.cost_models import data
from sp_plan.cost_models.hf_config import config_object_dict, parse_config_text
from sp_plan.cost_models.model_spec import ModelSpec, check_hf_sizes, model_from_hf_dict


def through_autoconfig(config: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """``config`` completed by its transformers config class (class defaults and attribute aliases), or
    ``config`` itself when transformers is absent or does not know its model_type. A value the class
    rejects is left for the cost models' parser, which says in one line what is wrong. A completion made
    before is read back from :mod:`.autoconfig_cache` without importing transformers."""
    version = autoconfig_cache.transformers_version()
    if version is None:
        return config
    key = autoconfig_cache.cache_key(config, version)
    cached = autoconfig_cache.load(key) if key else None
    if cached is not None:  # this content passed _complete's size check when it was stored
        return cached
    completed = _complete(config, name)
    if key:
        autoconfig_cache.store(key, completed)
    return completed


def _complete(config: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError:
        return config
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return config
    check_hf_sizes(config, name or model_type)  # before the class expands them
    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        completed = config_object_dict(AutoConfig.for_model(model_type, **fields))
    except Exception:  # noqa: BLE001 - any refusal by the class: the cost models' parser explains it
        return config
    return {**completed, **{k: v for k, v in config.items() if k not in completed}}


def load_config_file(path: Path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a local config.json (or its folder), read through :func:`through_autoconfig`."""
    if path.is_dir():
        path = path / "config.json"
    config = parse_config_text(data.read_user_text("models", path), str(path))
    # A hub snapshot's config.json is named after its folder; any other file after itself (a folder name
    # such as "configs" would name every file in it alike, and head every error about one of them).
    own = path.parent.name if path.name == "config.json" else path.stem
    name = name or own or path.stem
    return model_from_hf_dict(through_autoconfig(config, name), name=name)


__all__ = ["load_config_file", "through_autoconfig"]
