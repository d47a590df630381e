"""A mixture-of-experts plan's torchrun export trains as written (issue 35, item 10b).

The config.json is the one current transformers writes (``save_pretrained``): Qwen3-MoE's expert count is
stored as ``num_local_experts`` only, the name its config class maps ``num_experts`` to. The planner read it
through the class's alias table while ``sp-plan train --model`` read the raw file and refused it; and the
torchrun export left ``--model`` out, so the exported command trained the built-in dense model (refusing ep=2).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

BIN = pathlib.Path(sys.executable).parent


def _saved_qwen3_moe(folder: pathlib.Path, **overrides) -> pathlib.Path:
    sizes = dict(vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=512)
    transformers.Qwen3MoeConfig(**(sizes | overrides)).save_pretrained(folder)
    return folder / "config.json"


def _sp_plan(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(BIN / "sp-plan"), *args], capture_output=True, text=True, timeout=240, check=False,
                          cwd=cwd, env=env)


def test_saved_config_names_experts_by_the_alias(tmp_path: pathlib.Path) -> None:
    written = json.loads(_saved_qwen3_moe(tmp_path).read_text())
    assert "num_experts" not in written and written["num_local_experts"] == 4  # what makes this test bite


def test_runtime_builds_a_saved_moe_config(tmp_path: pathlib.Path) -> None:
    from sp_plan.runtime.models.hf.model import hf_model_from_config_file, hf_model_spec

    model = hf_model_from_config_file(_saved_qwen3_moe(tmp_path))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert hf_model_spec(model).moe.num_experts == 4


def test_runtime_bounds_the_aliased_count_before_building(tmp_path: pathlib.Path) -> None:
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.models.hf.model import hf_model_from_config_file

    path = _saved_qwen3_moe(tmp_path)
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"num_local_experts": 1 << 40}))
    with pytest.raises((RuntimeConfigError, ValueError)) as refused:
        hf_model_from_config_file(path)
    assert "num_local_experts" in str(refused.value)


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> pathlib.Path:
    """A folder holding the saved config (qwen3-moe-tiny/) and its ep=2 plan (plan.yaml), planned once."""
    root = tmp_path_factory.mktemp("moe-plan")
    _saved_qwen3_moe(root / "qwen3-moe-tiny")
    done = _sp_plan("plan", "--model", "qwen3-moe-tiny", "--seq-len", "64", "--gpus", "2", "--ep", "2",
                    "--dp-shard", "2", "--global-batch-tokens", "128", "--out", "plan.yaml", cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return root


def test_moe_export_without_its_config_is_refused_with_the_fix(planned: pathlib.Path) -> None:
    done = _sp_plan("export", "plan.yaml", "--to", "torchrun", cwd=planned)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "mixture-of-experts" in done.stderr and "--model CONFIG.JSON" in done.stderr, done.stderr


def test_moe_export_refuses_a_config_that_is_not_the_plans_model(planned: pathlib.Path) -> None:
    _saved_qwen3_moe(planned / "eight-experts", num_experts=8)
    done = _sp_plan("export", "plan.yaml", "--to", "torchrun", "--model", "eight-experts", cwd=planned)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "is not the plan's model" in done.stderr and "num_experts" in done.stderr, done.stderr


def test_train_refuses_a_config_that_is_not_the_plans_model(planned: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from sp_plan.planner.plan import load_plan
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.models.hf.model import hf_model_from_config_file
    from sp_plan.runtime.train_run import refuse_other_model

    plan = load_plan(str(planned / "plan.yaml"))
    refuse_other_model(plan, hf_model_from_config_file(planned / "qwen3-moe-tiny"), planned / "qwen3-moe-tiny")
    other = hf_model_from_config_file(_saved_qwen3_moe(tmp_path / "other", moe_intermediate_size=24))
    with pytest.raises(RuntimeConfigError, match="moe"):
        refuse_other_model(plan, other, tmp_path / "other")


def test_moe_torchrun_export_trains_as_written(planned: pathlib.Path) -> None:
    """The exported command, run as written on 2 CPU ranks (only the run's length added), trains ep=2."""
    exported = _sp_plan("export", "plan.yaml", "--to", "torchrun", "--model", "qwen3-moe-tiny", cwd=planned)
    assert exported.returncode == 0, exported.stderr
    command = exported.stdout.strip()
    assert shlex.split(command)[-2:] == ["--model", "qwen3-moe-tiny"], command
    length = "--steps 2 --corpus-bytes 100000 --no-progress --log-every 1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", f"{command} {length}"], capture_output=True, text=True, timeout=300,
                          check=False, cwd=planned, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "ep x2" in out or "(ep=2)" in out, out[-3000:]
    assert "done: 2 steps" in out, out[-3000:]
