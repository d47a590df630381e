"""Hostile numbers in user files and flags (issue 35, items 1, 3, 4): a config.json whose layer count a
transformers config class would expand for minutes, inline GPU specs of zero, denormal, infinite or NaN
throughput, integers longer than Python converts, and token counts of hundreds of digits. Each is one line
on stderr with exit 2, never a traceback, a hang or a non-JSON ``--json`` answer."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from sp_plan.cli.main import main
from sp_plan.cost_models.data import load
from sp_plan.cost_models.json_io import finite_or_null, json_loads, strict_dumps
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.units import parse_token_count


def refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err and err.strip(), err
    return err


TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
        "vocab_size": 512}


@pytest.mark.parametrize("model_type", ["gemma2", "qwen2", "llama"])
@pytest.mark.parametrize("command", ["estimate", "plan", "capacity"])
def test_a_huge_layer_count_is_refused_before_transformers_expands_it(model_type, command, tmp_path, capsys):
    """Was: Gemma2Config/Qwen2Config built a 2**31-entry layer_types list first (minutes, growing memory)."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": model_type, **TINY, "num_hidden_layers": 2**31}))
    extra = {"estimate": ["--seq-len", "4K", "--gpus", "8"], "plan": ["--seq-len", "4K", "--gpus", "8"],
             "capacity": ["--gpus", "8"]}[command]
    start = time.process_time()
    err = refused([command, "--model", config, *extra], capsys)
    assert time.process_time() - start < 30
    assert "num_hidden_layers" in err and "2147483648" in err and "10,000" in err


def test_a_huge_expert_count_is_refused_before_the_config_class(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", **TINY, "num_hidden_layers": 2,
                                  "num_experts": 10**12, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    err = refused(["estimate", "--model", config, "--seq-len", "4K", "--gpus", "8"], capsys)
    assert "num_experts" in err


def _topology_with_gpu(tmp_path, **gpu) -> str:
    spec = {**load("topologies", "dgx-h100"), "name": "mine",
            "gpu": {"name": "my-accel", "memory_bytes": 80 << 30, "peak_flops": {"bf16": 9.0e14},
                    "memory_bandwidth": 3.0e12, **gpu}}
    path = tmp_path / "mine.yaml"
    # yaml.safe_dump writes .inf/.nan for float infinities and NaN, as a user's file would hold them
    path.write_text(yaml.safe_dump(spec))
    return str(path)


BAD_PHYSICAL = [0, 1e-300, float("inf"), float("nan"), -1.0]


@pytest.mark.parametrize("value", BAD_PHYSICAL)
@pytest.mark.parametrize("field", ["peak_flops", "memory_bandwidth"])
@pytest.mark.parametrize("command", [["estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8"],
                                     ["plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--json"],
                                     ["topo", "show", "--json"]])
def test_inline_gpu_specs_out_of_physical_bounds_are_refused(value, field, command, tmp_path, capsys):
    """Was: ZeroDivisionError from estimate/plan, and Infinity/NaN (not JSON) from topo show --json, exit 0."""
    gpu = {"peak_flops": {"bf16": value}} if field == "peak_flops" else {"memory_bandwidth": value}
    topology = _topology_with_gpu(tmp_path, **gpu)
    args = [*command, topology] if command[0] == "topo" else [*command, "--topology", topology]
    err = refused(args, capsys)
    assert field in err


def test_topology_link_bandwidths_have_a_physical_floor(tmp_path, capsys):
    spec = load("topologies", "dgx-h100")
    spec = {**spec, "name": "slow", "node": {**spec["node"], "interconnect": {**spec["node"]["interconnect"],
                                                                         "bandwidth": 1e-300}}}
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(spec))
    err = refused(["estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--topology", path], capsys)
    assert "bandwidth" in err


def test_a_sane_inline_gpu_still_plans_with_strict_json(tmp_path, capsys):
    topology = _topology_with_gpu(tmp_path)
    main(["plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--topology", topology, "--json"])
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


HUGE = "9" * 5000


def test_an_integer_longer_than_python_converts_in_a_config_json(tmp_path, capsys):
    """Was: ValueError ('Exceeds the limit (4300 digits)') as a traceback."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": %s, "num_attention_heads": 4, '
                      '"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512}' % HUGE)
    err = refused(["estimate", "--model", config, "--seq-len", "4K", "--gpus", "8"], capsys)
    assert "4,300 digits" in err and str(config) in err


@pytest.mark.parametrize("command", [["estimate", "--model", "llama3-8b", "--seq-len", "8K"],
                                     ["topo", "show"]])
def test_an_integer_longer_than_python_converts_in_a_topology_yaml(command, tmp_path, capsys):
    path = tmp_path / "huge.yaml"
    path.write_text(f"name: huge\nnodes: {HUGE}\n")
    args = [*command, path] if command[0] == "topo" else [*command, "--topology", path]
    err = refused(args, capsys)
    assert "4,300 digits" in err


def test_an_integer_longer_than_python_converts_in_a_plan_file(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    main(["plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--out", plan])
    capsys.readouterr()
    plan.write_text(plan.read_text().replace("seq_len: 8192", f"seq_len: {HUGE}", 1))
    err = refused(["export", plan, "--to", "torchrun"], capsys)
    assert "4,300 digits" in err


@pytest.mark.parametrize("flag", ["--seq-len", "--document-length"])
@pytest.mark.parametrize("digits", [20, 400, 5000])
def test_token_counts_of_hundreds_of_digits_are_out_of_range_not_overflow(flag, digits, capsys):
    """Was: OverflowError (float infinity to int) for 400 digits."""
    args = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8K", flag, "9" * digits]
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and "out of range" in err
    assert len(err) < 400  # the number is shortened, not echoed in full


def test_token_count_parsing_is_exact():
    assert parse_token_count("1.5K") == 1536 and parse_token_count("0.5K") == 512
    with pytest.raises(CostModelError, match="whole number"):
        parse_token_count("1.0000000000000001K")
    with pytest.raises(CostModelError, match="out of range"):
        parse_token_count(2**100)


def test_json_helpers_are_strict():
    with pytest.raises(json.JSONDecodeError):
        json_loads("[" + HUGE + "]")
    with pytest.raises(CostModelError, match=r"at a\.1"):
        strict_dumps({"a": [1.0, float("nan")]})
    assert strict_dumps(finite_or_null({"loss": float("inf"), "ok": [1.5]})) == '{"loss": null, "ok": [1.5]}'
