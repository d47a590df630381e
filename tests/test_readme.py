"""The README's two set-up commands are the contract with users and CI: keep them true."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", setup, re.S)]


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each set-up command must be one line"


def test_ci_runs_the_readme_test_command():
    test_command = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, "the README's test command and .ci/run have drifted apart"
    assert "pytest" in test_command and "torch==2.13.0" in test_command


def test_main_command_uses_the_cli():
    assert "sp-plan " in _readme_commands()[0]
