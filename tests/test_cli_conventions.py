"""Command-line conventions a first-time user runs into (issue 17): every token count takes K/M suffixes,
model names get suggestions, common names resolve."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cost_models import CostModelError, get_model_preset
from planner.cli import cli, main


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def console(args: list[str], capsys) -> tuple[int, str]:
    """The console script's exit code and stderr (``main`` turns the project's errors into one line, exit 2)."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    return code, capsys.readouterr().err


def test_global_batch_tokens_take_suffixes_like_seq_len():
    base = ["plan", "--model", "llama3-8b", "--seq-len", "128K", "--gpus", "8", "--top", "1", "--json"]
    with_suffix = run(*base, "--global-batch-tokens", "1M")
    with_number = run(*base, "--global-batch-tokens", str(1 << 20))
    assert with_suffix.exit_code == 0, with_suffix.output
    assert json.loads(with_suffix.stdout)["plans"] == json.loads(with_number.stdout)["plans"]
    bad = run(*base, "--global-batch-tokens", "1.5X")
    assert bad.exit_code == 2 and "global batch" in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize(("alias", "canonical"), [("llama3.1-8b", "llama3-8b"), ("Llama3.1-70B", "llama3-70b"),
                                                  ("llama3.1-405b", "llama3-405b")])
def test_llama_3_1_names_resolve_to_their_architecture(alias, canonical):
    assert get_model_preset(alias) == get_model_preset(canonical)


def test_qwen3_8b_and_14b_presets_match_their_published_sizes():
    for name in ("qwen3-8b", "qwen3-14b"):
        model = get_model_preset(name)
        assert abs(model.num_params / model.published_params - 1) < 0.005


def test_unknown_model_suggests_the_closest_names(capsys):
    with pytest.raises(CostModelError, match="did you mean llama3-70b"):
        get_model_preset("lama3-70b")
    code, err = console(["estimate", "--model", "qwen3-8", "--seq-len", "8K", "--gpus", "8"], capsys)
    assert code == 2 and err.startswith("error: ") and "did you mean qwen3-8b" in err
