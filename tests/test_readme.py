"""The README is a contract with users and CI: its two set-up commands, and its training snippets run as written."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

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


def _python_block_after(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.multiproc
@pytest.mark.parametrize("heading", ["## Training from one call", "**Inside transformers' `Trainer`**"])
def test_readme_training_snippets_run_as_written(heading, tmp_path):
    """The README's training snippets, verbatim, on 2 CPU ranks under torchrun (they said they would)."""
    script = tmp_path / "snippet.py"
    script.write_text(_python_block_after(heading))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
