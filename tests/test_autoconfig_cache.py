"""The disk cache of transformers-completed configs: a hit equals the class's own completion, a second CLI
process plans without importing transformers, and nothing the cache cannot hold exactly is kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sp_plan.cli import autoconfig_cache
from sp_plan.cli.autoconfig import _complete, through_autoconfig

pytest.importorskip("transformers")

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 352,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("SP_PLAN_CACHE_DIR", str(folder))
    return folder / "autoconfig"


def test_a_hit_is_the_class_completion_with_its_types(cache):
    first = through_autoconfig(dict(TINY))
    assert len(list(cache.iterdir())) == 1
    second = through_autoconfig(dict(TINY))
    assert second == first == _complete(dict(TINY))
    # repr keeps what JSON would change: id2label's int keys, and bool vs int
    assert list(second["id2label"]) == [0, 1]
    assert [type(v) for v in second.values()] == [type(v) for v in first.values()]


def test_a_changed_config_or_release_misses(cache, monkeypatch):
    through_autoconfig(dict(TINY))
    through_autoconfig({**TINY, "hidden_size": 256})
    assert len(list(cache.iterdir())) == 2
    assert autoconfig_cache.cache_key(TINY, "1.0") != autoconfig_cache.cache_key(TINY, "2.0")


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(cache):
    expected = through_autoconfig(dict(TINY))
    (entry,) = cache.iterdir()
    for junk in ("{'hidden_size': ", "[1, 2]", "__import__('os').system('false')", ""):
        entry.write_text(junk)
        assert through_autoconfig(dict(TINY)) == expected
        assert autoconfig_cache.load(entry.name) == expected


def test_values_without_an_exact_literal_are_not_kept(cache):
    autoconfig_cache.store("k.repr", {"x": float("nan")})
    autoconfig_cache.store("o.repr", {"x": object()})
    assert not cache.exists() or not list(cache.iterdir())


def test_turned_off_or_unwritable_the_cache_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("SP_PLAN_CACHE_DIR", "off")
    assert autoconfig_cache.cache_dir() is None
    assert through_autoconfig(dict(TINY)) == _complete(dict(TINY))
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SP_PLAN_CACHE_DIR", str(blocker))  # a file where the folder should be
    assert through_autoconfig(dict(TINY)) == _complete(dict(TINY))


def test_without_transformers_nothing_is_cached(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert through_autoconfig(dict(TINY)) == TINY
    assert not cache.exists()


def test_the_second_cli_process_plans_without_importing_transformers(tmp_path, cache):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    probe = ("import sys, json; from sp_plan.cli.autoconfig import load_config_file; "
             f"spec = load_config_file(__import__('pathlib').Path({str(config)!r})); "
             "print(json.dumps([spec.model_dump(mode='json'), 'transformers' in sys.modules]))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                                      text=True).stdout) for _ in range(2)]
    assert runs[0][1] is True and runs[1][1] is False
    assert runs[0][0] == runs[1][0]
