"""``sp-plan train`` is what ``sp-plan export --to torchrun`` launches, and it runs from a plain install.

The real thing: a wheel built from a clean copy of the tree (tests/test_packaging.py's fixture), unpacked
and put on PYTHONPATH, with the working directory elsewhere so the checkout cannot be imported. There
``sp-plan plan --out`` writes a tiny plan, ``sp-plan export --to torchrun`` prints the command, and that
command (plus a step count and a small corpus) trains on 2 CPU gloo ranks. Also: the command's flags
follow the other subcommands' (token counts take K/M), ``--help`` does not import torch, and under
torchrun a bad option is reported once (by local rank 0), not once per rank.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sp_plan.cli.commands.train import parse_options
from tests.test_packaging import wheel  # noqa: F401  (fixture: one wheel built from a clean copy of the tree)

#: A 2-layer Llama with the byte-level vocabulary of sp-plan train's default corpus, as a HF config.json.
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 259, "max_position_embeddings": 4096}
#: What the test adds to the exported command: a few steps over a small slice of the stdlib corpus.
RUN_ARGS = ["--steps", "3", "--corpus-bytes", "100000", "--no-progress"]
#: Wall-clock bound of one 2-rank launch (start-up, planning check, 3 steps of a tiny model).
LAUNCH_TIMEOUT_S = 90


def _torchrun() -> list[str]:
    """The torchrun next to this interpreter, else the same launcher as a module."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:  # noqa: F811
    """A working directory outside the checkout, and an environment importing sp_plan only from the wheel."""
    site = tmp_path_factory.mktemp("site")
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path_factory.mktemp("work")
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    shown = subprocess.run([sys.executable, "-c", "import sp_plan.runtime.train_run as m; print(m.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert Path(shown.stdout.strip()).is_relative_to(site), shown.stdout
    return work, env


def _sp_plan(args: list[str], work: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sp_plan.cli", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.multiproc
@pytest.mark.timeout(600)  # the wheel build (shared by the module) is the slow part
def test_the_exported_torchrun_command_trains_from_a_wheel(installed):
    work, env = installed
    (work / "config.json").write_text(json.dumps(TINY_CONFIG))
    planned = _sp_plan(["plan", "--model", "config.json", "--seq-len", "512", "--gpus", "2", "--topology",
                        "dgx-h100", "--ring", "2", "--dtype", "fp32", "--global-batch-tokens", "512", "--out",
                        "plan.yaml"], work, env)
    assert planned.returncode == 0, planned.stderr[-2000:]
    exported = _sp_plan(["export", "plan.yaml", "--to", "torchrun"], work, env)
    assert exported.returncode == 0, exported.stderr[-2000:]
    command = exported.stdout.strip()
    assert command == "torchrun --standalone --nproc-per-node=2 -m sp_plan.cli train --plan plan.yaml"
    argv = shlex.split(command)
    done = subprocess.run([*_torchrun(), *argv[1:], *RUN_ARGS], cwd=work, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "plan: ring=2 on 2 rank(s)" in out, out[-2000:]
    match = re.search(r"done: 3 steps .* loss ([\d.]+) -> ([\d.]+);", out)
    assert match, out[-2000:]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_bad_option_under_torchrun_is_reported_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*_torchrun(), "--standalone", "--nproc-per-node=2", "-m", "sp_plan.cli", "train",
                           "--stepz", "3"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("No such option '--stepz'") == 1, out[-3000:]
    assert "exitcode  : 2" in out, out[-3000:]  # the ranks' own code: a usage error, not a crash
    assert not re.search(r'File ".*sp_plan', out), out[-3000:]  # no traceback through sp-plan's code


@pytest.mark.parametrize("local_rank, shown", [(None, True), ("0", True), ("1", False)])
def test_usage_errors_are_shown_by_local_rank_0_only(local_rank, shown, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    for argv, message in ((["--stepz", "3"], "No such option '--stepz'"),
                          (["--save-every", "5"], "--save-every needs --checkpoint-dir")):
        with pytest.raises(SystemExit) as exit_info:
            parse_options(argv)
        assert exit_info.value.code == 2
        assert (message in capsys.readouterr().err) == shown


def test_flags_follow_the_other_subcommands():
    options = parse_options(["--seq-len", "8K", "--ring", "2", "--no-tiled-mlp", "--zero", "2", "--no-sp-only",
                             "--checkpoint-dir", "ckpt", "--resume-or-start", "--no-progress"])
    assert options.seq_len == 8192 and options.ring == 2 and options.ulysses is None
    assert options.tiled_mlp is False and options.tiled_loss is None and options.zero_stage == 2
    assert options.sp_only is False and options.resume_or_start and not options.resume
    assert options.checkpoint_dir == Path("ckpt") and options.progress is False
    defaults = parse_options([])
    assert (defaults.seq_len, defaults.steps, defaults.lr, defaults.sp_only, defaults.progress) == (2048, 30, 2e-3,
                                                                                                    True, True)
    with pytest.raises(SystemExit):
        parse_options(["--seq-len", "8Q"])


def test_train_help_imports_no_torch():
    code = ("import sys; from sp_plan.cli.main import main; sys.argv = ['sp-plan', 'train', '--help']\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print('torch loaded:', 'torch' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "--plan FILE" in shown.stdout and "--resume-or-start" in shown.stdout
    assert shown.stdout.rstrip().endswith("torch loaded: False")
