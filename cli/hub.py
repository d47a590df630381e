"""``--model org/name``: a Hugging Face hub model id, resolved by fetching only its ``config.json``.

This is network I/O, so it lives in the CLI layer: the cost models' data resolver stays offline and
reads only shipped presets and local files. A reference is a hub id when it looks like ``org/name`` and
is neither a shipped preset nor an existing path; everything else goes to
:func:`sp_plan.cost_models.model_spec.load_model` as before.

The download goes through ``huggingface_hub`` (an optional extra: ``pip install 'sp-plan[hub]'``, also
pulled in by ``[hf]``) into the normal HF cache (``HF_HOME``/``HF_HUB_CACHE``), so a second call, or any
call with ``HF_HUB_OFFLINE=1``, reads the cached file without the network. A gated, missing or
unreachable repository is one line, and the whole lookup is bounded by :data:`HUB_TIMEOUT_S` (the
client's own timeouts bound each request; the wall-clock bound catches anything else, so a dead network
never holds a planning command for minutes).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from pathlib import Path

from sp_plan.cli.autoconfig import load_config_file
from sp_plan.cost_models import data
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.model_spec import ModelSpec

#: ``org/name`` as the hub spells repository ids (letters, digits, ``-``, ``_``, ``.``; at most 96 each).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
#: Seconds the whole lookup may take before it is refused.
HUB_TIMEOUT_S = 30.0
#: Seconds the client waits for the server's answer to one request.
REQUEST_TIMEOUT_S = 10.0


def is_hub_id(reference: str) -> bool:
    """Whether ``reference`` names a hub repository: ``org/name``, no shipped preset, no existing path."""
    text = reference.strip()
    if not HUB_ID.fullmatch(text) or text.endswith(".json"):
        return False
    return data.canonical("models", text) is None and not Path(text).expanduser().exists()


def load_hub_model(repo_id: str, timeout_s: float = HUB_TIMEOUT_S) -> ModelSpec:
    """The ModelSpec of hub repository ``repo_id`` from its ``config.json`` (downloaded into the HF cache,
    or read from it when cached or offline)."""
    return load_config_file(_config_path(repo_id, timeout_s), name=repo_id)


def _config_path(repo_id: str, timeout_s: float) -> Path:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise CostModelError(f"--model {repo_id} is a Hugging Face hub id, which needs huggingface_hub: "
                             "pip install 'sp-plan[hub]', or give a local config.json") from None
    outcome: dict[str, object] = {}

    def fetch() -> None:
        try:
            outcome["path"] = hf_hub_download(repo_id, "config.json", etag_timeout=REQUEST_TIMEOUT_S,
                                              local_files_only=not _hub_resolves())
        except BaseException as exc:  # handed to the caller's thread, which explains it
            outcome["error"] = exc

    worker = threading.Thread(target=fetch, name=f"hub config {repo_id}", daemon=True)
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its per-retry warnings would bury the one line that explains
    try:
        worker.start()
        worker.join(timeout_s)
    finally:
        hub_logger.setLevel(level)
    if worker.is_alive():
        raise CostModelError(f"--model {repo_id}: the Hugging Face hub did not answer within {timeout_s:.0f} s; "
                             "check the network, or download config.json and give its path")
    error = outcome.get("error")
    if error is None:
        return Path(str(outcome["path"]))
    raise _explain(repo_id, error, hub_errors) from None


def _hub_resolves() -> bool:
    """Whether the hub's host name resolves. Without DNS (no network) the client retries each request five
    times with backoff (about 25 s) before it reads the cache: skip straight to the cache instead."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
    except OSError:  # socket.gaierror: no such host, or no resolver
        return False
    return True


def _explain(repo_id: str, error: BaseException, hub_errors) -> CostModelError:
    """One line for each way fetching a config.json fails (the most specific error class first)."""
    where = f"--model {repo_id}"
    if isinstance(error, hub_errors.GatedRepoError):
        return CostModelError(f"{where}: the repository is gated; accept its licence on huggingface.co and log in "
                              "(hf auth login or HF_TOKEN), or give a local config.json")
    if isinstance(error, hub_errors.RepositoryNotFoundError):
        return CostModelError(f"{where}: no such repository on the Hugging Face hub (or it is private); check the "
                              "id, or give a preset name or a local config.json")
    if isinstance(error, hub_errors.RevisionNotFoundError):
        return CostModelError(f"{where}: the repository has no main revision; give a local config.json")
    if isinstance(error, hub_errors.LocalEntryNotFoundError):
        return CostModelError(f"{where}: config.json is not in the Hugging Face cache and the hub cannot be reached "
                              "(offline: HF_HUB_OFFLINE is set, or no network); run once online or give a local "
                              "config.json")
    if isinstance(error, hub_errors.EntryNotFoundError):
        return CostModelError(f"{where}: the repository has no config.json, so it is not a transformers model; "
                              "give a local config.json")
    if isinstance(error, hub_errors.HfHubHTTPError):
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return CostModelError(f"{where}: the Hugging Face hub refused the download ({first}); give a local "
                              "config.json")
    if isinstance(error, (OSError, ValueError)):
        return CostModelError(f"{where}: cannot fetch config.json ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else 'no detail'}); check the network "
                              "or give a local config.json")
    return CostModelError(f"{where}: fetching config.json failed ({type(error).__name__}); give a local config.json")


__all__ = ["HUB_ID", "HUB_TIMEOUT_S", "is_hub_id", "load_hub_model"]
