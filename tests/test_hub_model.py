"""``--model org/name``: a hub id is resolved from the HF cache (offline here: a fake cache in tmp_path with
the hub's layout) through the console script, and every way a lookup fails is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sp_plan.cli import hub
from sp_plan.cost_models import CostModelError, get_model_preset

SCRIPT = Path(sys.executable).with_name("sp-plan")
FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, repo_id: str, config_text: str) -> Path:
    """The hub cache layout huggingface_hub reads: models--org--name/{refs/main, snapshots/<hash>/config.json}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(config_text)
    return root


def sp_plan(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "home")}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_a_hub_id_is_read_from_the_cache_offline_through_the_console_script(tmp_path):
    cache = fake_cache(tmp_path / "hub", "mistralai/Mistral-7B-v0.1", (FIXTURES / "mistral-7b-v0.1.json").read_text())
    args = ["--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--json"]
    done = sp_plan(["estimate", "--model", "mistralai/Mistral-7B-v0.1", *args], cache, tmp_path)
    assert done.returncode == 0, done.stderr
    preset = sp_plan(["estimate", "--model", "mistral-7b", *args], cache, tmp_path)
    assert preset.returncode == 0, preset.stderr
    from_hub, shipped = json.loads(done.stdout), json.loads(preset.stdout)
    # the same architecture as the v0.1 preset: the same memory and step time
    assert from_hub["memory"] == shipped["memory"] and from_hub["time"]["step_s"] == shipped["time"]["step_s"]


def test_an_uncached_hub_id_offline_is_one_line(tmp_path):
    cache = fake_cache(tmp_path / "hub", "other/model", "{}")
    done = sp_plan(["estimate", "--model", "google/gemma-2-9b", "--seq-len", "8K", "--gpus", "8"], cache, tmp_path)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0] and "Traceback" not in done.stderr


def test_what_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id("mistralai/Mistral-7B-v0.1") and hub.is_hub_id("Qwen/Qwen2.5-7B")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    assert not hub.is_hub_id("local/model")  # an existing folder stays a path
    assert not hub.is_hub_id("mistral-7b") and not hub.is_hub_id("a/b/c") and not hub.is_hub_id("x/config.json")
    assert not hub.is_hub_id("../x")


def _raising(error: BaseException):
    def download(*args, **kwargs):
        raise error

    return download


@pytest.mark.parametrize("name, message", [
    ("GatedRepoError", "gated"),
    ("RepositoryNotFoundError", "no such repository"),
    ("EntryNotFoundError", "has no config.json"),
    ("LocalEntryNotFoundError", "not in the Hugging Face cache"),
])
def test_hub_failures_are_one_line(name, message, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    cls = getattr(errors, name)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _raising(cls.__new__(cls)))
    with pytest.raises(CostModelError, match=message) as info:
        hub.load_hub_model("org/name")
    assert "\n" not in str(info.value)


def test_a_hub_that_does_not_answer_is_refused_in_bounded_time(monkeypatch):
    import threading

    import huggingface_hub

    release = threading.Event()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: release.wait(30))
    try:
        with pytest.raises(CostModelError, match="did not answer within"):
            hub.load_hub_model("org/name", timeout_s=0.2)
    finally:
        release.set()


def test_a_cached_config_gets_the_hub_id_as_its_name(tmp_path, monkeypatch):
    import huggingface_hub

    path = tmp_path / "config.json"
    path.write_text((FIXTURES / "gemma-2-9b.json").read_text())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(path))
    model = hub.load_hub_model("google/gemma-2-9b")
    assert model.name == "google/gemma-2-9b"
    assert model.num_params == get_model_preset("gemma-2-9b").num_params
