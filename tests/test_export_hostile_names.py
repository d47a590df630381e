"""Plan text that reaches a shell (issue #35, item 2): a model name, a plan file name or a training script
holding a newline and a command, ``$(...)``, backticks or quotes must stay one literal word (or a comment) in
every export that writes a script or a command line (megatron: the bash script and its ``--json`` command;
torchrun: the command). The exports are run for real by bash in a sandbox whose PATH holds stand-in
launchers that only record their argv, and nothing may create the PWNED file."""

import json
import shutil
import subprocess

import pytest
import yaml
from click.testing import CliRunner

from sp_plan.cli.main import cli

HOSTILE = {
    "newline": "evil\ntouch PWNED\n",
    "subst": "evil$(touch PWNED)",
    "backticks": "evil`touch PWNED`",
    "single_quote": "evil'; touch PWNED; echo '",
    "double_quote": 'evil"; touch PWNED; echo "',
    "mixed": "evil\n$(touch PWNED)`touch PWNED`'\"\\ ; touch PWNED #",
}
LAUNCHERS = ("torchrun", "python", "python3", "deepspeed", "accelerate")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A Megatron plan (TP x DP, one node), a two-node Megatron plan and a plain one, from `sp-plan plan`."""
    root = tmp_path_factory.mktemp("plans")
    made = {}
    for name, extra in (("megatron", ["--stack", "megatron", "--gpus", "8"]),
                        ("megatron2", ["--stack", "megatron", "--gpus", "16", "--gpus-per-node", "8"]),
                        ("plain", ["--gpus", "8"])):
        out = root / f"{name}.yaml"
        result = _invoke("plan", "--model", "llama3-8b", "--seq-len", "8K", "--gpu", "h100-80gb", *extra,
                         "--out", str(out))
        assert result.exit_code == 0, result.output
        made[name] = yaml.safe_load(out.read_text())
    return made


def _renamed(plan: dict, name: str, path) -> str:
    data = json.loads(json.dumps(plan))
    data["model"]["name"] = name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.fixture
def sandbox(tmp_path):
    """A working directory and a PATH of stand-ins that write their argv (NUL-separated) and exit 0."""
    work, fake = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    fake.mkdir()
    for tool in LAUNCHERS:
        exe = fake / tool
        exe.write_text(f'#!/bin/bash\nprintf "%s\\0" {tool} "$@" >> "$ARGV_LOG"\nexit 0\n')
        exe.chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "ARGV_LOG": str(tmp_path / "argv.log"), "HOME": str(tmp_path),
           "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    return work, env, tmp_path / "argv.log"


def _run_bash(args, work, env):
    run = subprocess.run(["bash", *args], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run


def _argvs(log) -> list[list[str]]:
    words = log.read_text().split("\0")[:-1]
    calls, current = [], []
    for word in words:
        if word in LAUNCHERS and current:
            calls.append(current)
            current = []
        current.append(word)
    return calls + [current]


def _assert_not_pwned(tmp_path):
    assert not list(tmp_path.rglob("PWNED")), "a hostile name ran a command"


@pytest.mark.parametrize("kind", ["megatron", "megatron2"])
@pytest.mark.parametrize("label", sorted(HOSTILE))
def test_megatron_script_keeps_hostile_model_name_inert(plans, sandbox, tmp_path, kind, label):
    work, env, log = sandbox
    name = HOSTILE[label]
    plan_file = _renamed(plans[kind], name, tmp_path / "plan.yaml")
    script = tmp_path / "megatron.sh"
    result = _invoke("export", plan_file, "--to", "megatron", "--out", str(script))
    assert result.exit_code == 0, result.output
    text = script.read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert len(comments) == 2 and "evil" in comments[1]  # the shebang, then the one-line header
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    _run_bash([str(script)], work, env)
    _assert_not_pwned(tmp_path)
    as_json = _invoke("export", plan_file, "--to", "megatron", "--json")
    data = json.loads(as_json.stdout)
    (call,) = _argvs(log)
    assert call[call.index("pretrain_gpt.py") + 1:] == data["argv"]
    # The --json command line, run by bash, launches the same argv.
    log.unlink()
    _run_bash(["-c", data["command"]], work, env)
    _assert_not_pwned(tmp_path)
    (call,) = _argvs(log)
    assert call[call.index("pretrain_gpt.py") + 1:] == data["argv"]


def test_megatron_script_escapes_nul_and_control_characters(plans, sandbox, tmp_path):
    work, env, log = sandbox
    plan_file = _renamed(plans["megatron"], "evil\0\r\x1b[2J\ntouch PWNED", tmp_path / "plan.yaml")
    script = tmp_path / "megatron.sh"
    result = _invoke("export", plan_file, "--to", "megatron", "--out", str(script))
    assert result.exit_code == 0, result.output
    header = script.read_text().splitlines()[1]
    assert header.startswith("# ") and "evil\\x00\\r\\x1b[2J\\ntouch PWNED" in header
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    _run_bash([str(script)], work, env)
    _assert_not_pwned(tmp_path)


@pytest.mark.parametrize("label", sorted(HOSTILE))
def test_torchrun_command_keeps_hostile_plan_path_and_script_literal(plans, sandbox, tmp_path, label):
    """The plan file's own name and the --script path enter the torchrun command: each stays one argument."""
    work, env, log = sandbox
    hostile = HOSTILE[label].replace("/", "_")
    folder = tmp_path / "plans"
    folder.mkdir()
    plan_file = _renamed(plans["plain"], hostile, folder / f"{hostile}.yaml")
    script = f"{hostile}.py"
    result = _invoke("export", plan_file, "--to", "torchrun", "--script", script)
    assert result.exit_code == 0, result.output
    command = result.stdout.strip()
    subprocess.run(["bash", "-n", "-c", command], check=True, timeout=30)
    _run_bash(["-c", command], work, env)
    _assert_not_pwned(tmp_path)
    (call,) = _argvs(log)
    assert call[0] == "torchrun" and call[-3:] == [script, "--plan", plan_file]


def test_torchrun_multi_node_keeps_only_rendezvous_words_for_the_shell(plans, sandbox, tmp_path):
    work, env, log = sandbox
    data = json.loads(json.dumps(plans["megatron2"]))
    plan_file = _renamed(data, "evil", tmp_path / "plan.yaml")
    script = "--node-rank=$(touch PWNED)"
    result = _invoke("export", plan_file, "--to", "torchrun", "--script", script)
    assert result.exit_code == 0, result.output
    _run_bash(["-c", result.stdout.strip()], work, env)
    _assert_not_pwned(tmp_path)
    (call,) = _argvs(log)
    assert "--node-rank=0" in call and "--rdzv-endpoint=127.0.0.1:29500" in call and script in call


def test_torchrun_refuses_nul_in_script(plans):
    from sp_plan.planner.errors import PlannerError
    from sp_plan.planner.export import to_torchrun
    from sp_plan.planner.plan import plan_from_dict

    with pytest.raises(PlannerError, match="NUL byte") as info:
        to_torchrun(plan_from_dict(plans["plain"]), script="train\0.py")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["a\ntouch PWNED", "tab\there", "esc\x1b[2Jx", "it's $(id)"])
def test_the_replan_command_in_a_refusal_is_one_line_and_reads_back_the_name(name, plans):
    """A plan refused under an exporter's stack names the `sp-plan plan` command to re-plan with: a model
    name with a newline split that one-line message (shlex keeps the newline inside its quotes); bash's
    $'...' quoting keeps it one line, and bash reads the same name back."""
    import shlex

    from sp_plan.planner.export import replan_command
    from sp_plan.planner.plan import plan_from_dict

    data = json.loads(json.dumps(plans["plain"]))
    data["model"]["name"] = name
    command = replan_command(plan_from_dict(data), "deepspeed", "hf-deepspeed")
    assert "\n" not in command and command.startswith("sp-plan plan --model "), command
    words = subprocess.run(["bash", "-c", f"set -- {command.split(' ', 3)[3]}; printf '%s' \"$1\""],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert words == name, (command, words)
    if name.isprintable():
        assert shlex.split(command)[3] == name
