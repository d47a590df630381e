"""Fuzz every ``sp-plan`` subcommand with malformed, extreme and hostile input (issue 16).

Whatever the input, the CLI must answer as the README documents: exit 0 (an answer), 1 ("no plan
fits") or 2 (bad input: one line on stderr), never a Python traceback; and an exit-0 ``--json`` answer
holds no NaN, infinite, negative or absurd figure. The bulk runs in-process through the real entry point
(:func:`sp_plan.cli.main.main`, whose error handling is what the console script runs) under click's
``CliRunner`` isolation; a few cases go through the installed ``sp-plan`` console script to check exit
codes end to end. Hypothesis is derandomized (the same examples on every run) so CI is reproducible;
validate is fuzzed on its argument checks only (nothing here launches ranks) and probe on arguments that
are refused before it measures anything.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sp_plan.cli.main import main

FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

#: Tokens that break naive number parsing: signs, zero, huge, non-finite, bad suffixes, empty, junk.
HOSTILE_NUMBERS = ["0", "-1", "-8", "1e400", "inf", "-inf", "nan", "NaN", "1.5", "0x10", "", " ", "8K8", "1Q",
                   "99999999999999999999999", str(1 << 64), "1_000", "１２８", "\x00", "8 8", "--", "1e-308",
                   "4G", "1T", "-1M", "1KK", "K"]
#: Hostile file contents (written to a temporary file per case).
HOSTILE_FILES: dict[str, bytes] = {
    "empty": b"",
    "binary": bytes(range(256)) * 4,
    "latin1": "name: caf\xe9\n".encode("latin-1"),
    "yaml_list": b"- 1\n- 2\n",
    "yaml_scalar": b"42\n",
    "yaml_bad": b"a: [1, 2\n",
    "yaml_deep": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "yaml_alias_bomb": b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                       b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
    "yaml_huge": b"k: [" + b"1, " * 3_000_000 + b"1]\n",
    "json_deep": b"[" * 100_000 + b"]" * 100_000,
    "json_inf": b'{"model_type": "llama", "hidden_size": Infinity, "num_attention_heads": 0}',
    "wrong_types": b"name: [1]\nnodes: {a: b}\nkind: 7\nversion: x\nkernels: [1, 2]\n",
}

#: Where an exit-0 figure is absurd: no real step takes 11 days, nothing else reaches 1e30.
MAX_STEP_S = 1e6
MAX_FIGURE = 1e30


def run_cli(args: list[Any]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the ``sp-plan`` entry point run in-process. An exception escaping
    ``main`` (a traceback for a user) propagates and fails the test."""
    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        stdout, stderr = out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")
    return code, stdout, stderr


def _numbers(data: Any, path: str = ""):
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numbers(value, f"{path}.{key}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _numbers(value, f"{path}[{i}]")
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield path, float(data)


def check(args: list[Any], allowed: tuple[int, ...] = (0, 1, 2)) -> tuple[int, str, str]:
    """Run and assert the documented contract; returns the result for extra assertions."""
    code, stdout, stderr = run_cli(args)
    assert "Traceback" not in stderr and "Traceback" not in stdout, (args, stderr)
    assert code in allowed, (args, code, stderr[-2000:])
    if code == 2 and stderr.startswith("error: "):
        assert stderr.count("\n") == 1, (args, stderr)  # one line (click's own usage errors have their format)
    if code == 0 and "--json" in [str(a) for a in args]:
        for path, value in _numbers(json.loads(stdout)):
            assert math.isfinite(value) and value >= 0, (args, path, value)
            assert value <= (MAX_STEP_S if path.endswith("_s") else MAX_FIGURE), (args, path, value)
    return code, stdout, stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Every hostile file, plus a directory, a missing path and a valid plan file to mutate."""
    root = tmp_path_factory.mktemp("fuzz")
    out = {name: root / f"{name}.yaml" for name in HOSTILE_FILES}
    for name, content in HOSTILE_FILES.items():
        out[name].write_bytes(content)
    out["directory"] = root / "a_directory"
    out["directory"].mkdir()
    out["missing"] = root / "missing.yaml"
    out["plan"] = root / "plan.yaml"
    code, _, err = run_cli(["plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--top", "1",
                            "--out", out["plan"]])
    assert code == 0, err
    return out


HOSTILE_FILE_NAMES = [*HOSTILE_FILES, "directory", "missing"]


# ----- estimate (hypothesis: numbers and flags) ------------------------------------------------------------

#: Mostly plausible values (so most examples reach the cost model and its answer is checked), the rest
#: hostile.
number_token = st.one_of(st.sampled_from(["1", "2", "4", "8", "16", "128K", "1M", "32K", "4096", "8K"]),
                         st.sampled_from(["1", "2", "4", "8", "64", "256K", "16K", "2M"]),
                         st.sampled_from(HOSTILE_NUMBERS), st.integers(-3, 1 << 21).map(str))


@settings(FUZZ, max_examples=150)
@given(seq=number_token, gpus=number_token, degree=st.sampled_from(["--ulysses", "--ring", "--tp", "--dp-shard"]),
       value=number_token, micro=number_token, mode=st.sampled_from(["train", "prefill", "decode", ""]),
       model=st.sampled_from(["llama3-8b", "llama3-70b", "qwen2.5-7b", "", "nope", "../x.json", "llama3-8b "]))
def test_fuzz_estimate(seq, gpus, degree, value, micro, mode, model):
    check(["estimate", "--model", model, "--seq-len", seq, "--gpus", gpus, degree, value, "--micro-batch", micro,
           "--mode", mode, "--json"])


@pytest.mark.parametrize("option", ["--model", "--topology", "--calibration", "--stack"])
@pytest.mark.parametrize("name", HOSTILE_FILE_NAMES)
def test_fuzz_estimate_files(option, name, files, tmp_path):
    path = files[name]
    if option == "--model" and name in HOSTILE_FILES:  # a config.json path must end in .json
        path = tmp_path / f"{name}.json"
        path.write_bytes(HOSTILE_FILES[name])
    args = ["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--json"]
    check([*args, option, path], allowed=(2,))


@pytest.mark.parametrize("assume", ["", "=", "x=1", "fragmentation_fraction=nan", "fragmentation_fraction=-1",
                                    "fragmentation_fraction=1e400", "norm_implementation=", "=eager",
                                    "cuda_context_bytes=1e30"])
def test_fuzz_estimate_assume(assume):
    check(["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--assume",
           assume, "--json"])


# ----- plan and capacity (a bounded table: each answer runs a search) --------------------------------------

PLAN_CASES = [
    ["--seq-len", "0", "--gpus", "8"], ["--seq-len", "-1M", "--gpus", "8"], ["--seq-len", "1e400", "--gpus", "8"],
    ["--seq-len", "32K", "--gpus", "0"], ["--seq-len", "32K", "--gpus", "12"], ["--seq-len", "32K"],
    ["--seq-len", "32K", "--gpus", "8", "--headroom", "nan"], ["--seq-len", "32K", "--gpus", "8", "--headroom", "1"],
    ["--seq-len", "32K", "--gpus", "8", "--global-batch-tokens", "0"],
    ["--seq-len", "32K", "--gpus", "8", "--max-offload-gb", "inf"],
    ["--seq-len", "32K", "--gpus", "8", "--max-offload-gb", "-1"],
    ["--seq-len", "32K", "--gpus", "8", "--top", "0"], ["--seq-len", "32K", "--gpus", "8", "--ulysses", "3"],
    ["--seq-len", "32K", "--gpus", "8", "--grad-accum", "2"],
    ["--seq-len", "32K", "--gpus", "8", "--topology", ""], ["--seq-len", "32K", "--topology", "dgx-h100@nope"],
    ["--seq-len", "32K", "--gpus", "8", "--out", "/nonexistent/dir/plan.yaml"],
    ["--seq-len", "32K", "--gpus", "8", "--json"],                       # an answer
    ["--seq-len", "2M", "--gpus", "1", "--model", "llama3-70b", "--json"],  # no plan fits: exit 1
]


@pytest.mark.parametrize("args", PLAN_CASES, ids=lambda a: " ".join(a)[:60])
def test_fuzz_plan(args):
    model = [] if "--model" in args else ["--model", "llama3-8b"]
    code, _, _ = check(["plan", *model, *args])
    if args[-1] == "--json" and "llama3-70b" in args:
        assert code == 1


CAPACITY_CASES = [
    ["--gpus", "8", "--sweep", ""], ["--gpus", "8", "--sweep", "gpus="], ["--gpus", "8", "--sweep", "seq=abc"],
    ["--seq-len", "32K", "--sweep", "gpus=0,8"], ["--seq-len", "32K", "--sweep", "gpus=-8"],
    ["--seq-len", "32K", "--sweep", "gpus=1e400"], ["--gpus", "8", "--sweep", "seq=0"],
    ["--gpus", "8", "--sweep", "tokens=8"], ["--sweep", "seq=32K"], ["--seq-len", "32K", "--max-gpus", "0"],
    ["--gpus", "8", "--plot", "x.png"], ["--seq-len", "32K", "--sweep", "gpus=8", "--plot", "/nonexistent/p.png"],
    [],
    ["--gpus", "8", "--sweep", "seq=16K,1G", "--json"],  # a point beyond the bound
    ["--seq-len", "32K", "--sweep", "gpus=8", "--json"],  # an answer
]


@pytest.mark.parametrize("args", CAPACITY_CASES, ids=lambda a: " ".join(a)[:60])
def test_fuzz_capacity(args):
    check(["capacity", "--model", "llama3-8b", *args])


# ----- export, topo show, probe, validate --------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_FILE_NAMES)
def test_fuzz_export_hostile_plan_files(name, files):
    check(["export", files[name], "--to", "torchrun"], allowed=(2,))


@pytest.mark.parametrize("edit", ["num_gpus", "layout", "truncate", "marker", "format", "model_heads", "types"])
def test_fuzz_export_edited_plans(edit, files, tmp_path):
    text = files["plan"].read_text()
    data = yaml.safe_load(text)
    if edit == "num_gpus":
        data["hardware"]["num_gpus"] = 64
    elif edit == "layout":
        data["layout"]["ring"] = 3
    elif edit == "marker":
        data.pop("end_of_plan")
    elif edit == "format":
        data["sp_plan_format"] = "1; rm -rf /"
    elif edit == "model_heads":
        data["model"]["num_heads"] = 0
    elif edit == "types":
        data["train"]["seq_len"] = [1, 2]
    path = tmp_path / "edited.yaml"
    path.write_text(text[: len(text) // 2] if edit == "truncate" else yaml.safe_dump(data, sort_keys=False))
    check(["export", path, "--to", "deepspeed"], allowed=(2,))


@pytest.mark.parametrize("target", ["torchrun", "accelerate", "deepspeed", "slurm", ""])
def test_fuzz_export_targets_and_out(target, files, tmp_path):
    check(["export", files["plan"], "--to", target, "--out", tmp_path / "missing" / "x"], allowed=(2,))
    check(["export", files["plan"], "--to", target, "--out", files["directory"]], allowed=(2,))


@FUZZ
@given(ref=st.sampled_from(["dgx-h100", "dgx-h100@", "dgx-h100@efa:", "dgx-h100@efa:0", "dgx-h100@efa:1e9",
                            "@", "", " ", "nope", "dgx-h100@nope", "l40s-pcie@roce-400:-1", "/", "."]),
       gpus=st.one_of(st.none(), number_token), per_node=st.one_of(st.none(), number_token))
def test_fuzz_topo_show(ref, gpus, per_node):
    args = ["topo", "show", ref]
    args += ["--gpus", gpus] if gpus is not None else []
    args += ["--gpus-per-node", per_node] if per_node is not None else []
    check(args)


@pytest.mark.parametrize("name", HOSTILE_FILE_NAMES)
def test_fuzz_topo_show_files(name, files):
    check(["topo", "show", files[name]], allowed=(2,))


@pytest.mark.parametrize("args", [
    ["--sizes", "1,2,3"], ["--sizes", ""], ["--sizes", "1K"], ["--sizes", "8G,16G,32G"], ["--sizes", "-1,2,3"],
    ["--sizes", "a,b,c"], ["--compute-budget", "0"], ["--compute-budget", "nan"], ["--link-budget", "-1"],
    ["--out", "/nonexistent/dir/topo.yaml"], ["--out", ""],
])
def test_fuzz_probe_arguments(args):
    """Only arguments refused before anything is measured (a probe that runs takes seconds and torch)."""
    check(["probe", *args], allowed=(2,))


@pytest.mark.parametrize("args", [
    [], ["--model", "llama3-8b"], ["--model", "llama3-8b", "--seq-len", "4K"],
    ["--model", "llama3-8b", "--seq-len", "abc", "--gpus", "2"], ["--model", "llama3-8b", "--seq-len", "-4K",
                                                                   "--gpus", "2"],
    ["--model", "llama3-8b", "--seq-len", "4K", "--gpus", "0"], ["--steps", "0"], ["--layers", "-1"],
    ["--plan", "{missing}"], ["--plan", "{binary}"], ["--plan", "{directory}"], ["--plan", "{yaml_deep}"],
    ["--plan", "{empty}"], ["--plan", "{yaml_list}"],
])
def test_fuzz_validate_argument_checks(args, files):
    """Argument validation only: every case is refused before a rank could be launched."""
    check(["validate", *[a.format(**files) for a in args]], allowed=(2,))


# ----- calibrate (hypothesis: CSV cells) ------------------------------------------------------------------------

cell = st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.text(max_size=8),
                 st.sampled_from(["llama3-8b", "dgx-h100", "8", "32768", "2.5", "full", "true"]))


@FUZZ
@given(header=st.lists(st.sampled_from(["model", "seq_len", "gpus", "ulysses", "ring", "topology", "step_s",
                                        "tps_per_gpu", "zero", "micro_batch", "id", ""]), min_size=0, max_size=7,
                       unique=True),
       rows=st.lists(st.lists(cell, min_size=0, max_size=8), min_size=0, max_size=3))
def test_fuzz_calibrate_csv(header, rows, tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "runs.csv"
    lines = [",".join(header)] + [",".join(c.replace(",", ";").replace("\n", " ").replace("\r", " ")
                                           .replace('"', "") for c in row) for row in rows]
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "replace"))
    check(["calibrate", path, "--out", path.with_suffix(".yaml"), "--json"])


@pytest.mark.parametrize("name", HOSTILE_FILE_NAMES)
def test_fuzz_calibrate_hostile_files(name, files, tmp_path):
    for suffix in (".csv", ".json"):
        path = files[name]
        if path.exists() and path.is_file():
            path = tmp_path / f"{name}{suffix}"
            path.write_bytes(HOSTILE_FILES[name])
        check(["calibrate", path, "--out", tmp_path / "cal.yaml"], allowed=(2,))


def test_fuzz_calibrate_one_valid_run_answers_with_finite_errors(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("model,seq_len,gpus,ulysses,topology,step_s\nllama3-8b,32768,8,8,dgx-h100,2.5\n")
    code, stdout, _ = check(["calibrate", path, "--out", tmp_path / "cal.yaml", "--json"])
    assert code == 0 and json.loads(stdout)["errors"]


# ----- end to end through the console script --------------------------------------------------------------------


def console_script() -> Path:
    script = Path(sys.executable).parent / "sp-plan"
    if not script.exists():
        pytest.skip(f"no sp-plan console script next to {sys.executable} (install the package)")
    return script


@pytest.mark.parametrize("args, code", [
    (["estimate", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--ulysses", "8", "--json"], 0),
    (["plan", "--model", "llama3-70b", "--seq-len", "2M", "--gpus", "1"], 1),
    (["estimate", "--model", "llama3-8b", "--seq-len", "1e400", "--gpus", "8"], 2),
    (["topo", "show", "dgx-h100", "--out", "/nonexistent/dir/t.yaml"], 2),
    (["calibrate", "/nonexistent.csv"], 2),
])
def test_console_script_exit_codes(args, code):
    done = subprocess.run([str(console_script()), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [
    ["--steps", "0"], ["--steps", "-3"], ["--micro-batch", "0"], ["--global-batch", "-1"], ["--lr", "nan"],
    ["--lr", "0"], ["--lr", "inf"], ["--seed", "-1"], ["--layers", "0"], ["--hidden", "-1"], ["--heads", "1e9"],
    ["--kv-heads", "x"], ["--ffn", "0"], ["--corpus-bytes", "0"], ["--save-every", "-1"],
    ["--keep-checkpoints", "0"], ["--log-every", "-1"], ["--live-bytes-every", "-1"], ["--ulysses", "0"],
    ["--ring", "-2"], ["--tp", "abc"], ["--zero", "4"], ["--seq-len", "abc"], ["--seq-len", "-4K"],
])
def test_fuzz_train_argument_checks(args):
    """Refused while parsing, before torch or a rank starts: one line, exit 2."""
    check(["train", *args], allowed=(2,))


# ----- lengths (hypothesis: CSV rows and JSON bins; hostile files) -----------------------------------------------

length_cell = st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.integers(-5, 1 << 40).map(str),
                        st.sampled_from(["512", "1", "131072", "2.5", "1e9"]))


@settings(FUZZ, max_examples=40)  # a planning run takes ~0.5 s: 40 draws keep this test near 20 s
@given(rows=st.lists(st.tuples(length_cell, length_cell), min_size=0, max_size=5),
       header=st.sampled_from(["length,count", "count,length", "length", "", "length,count,extra"]),
       command=st.sampled_from(["show", "plan", "estimate"]))
def test_fuzz_lengths_csv(rows, header, command, tmp_path_factory):
    """A length file of hostile rows: ``lengths --show`` summarises it or refuses it in one line, and so do
    the planning commands that read it with --lengths (exit 0, 1 or 2, never a traceback)."""
    path = tmp_path_factory.mktemp("len") / "lengths.csv"
    path.write_text("\n".join([header, *(f"{a},{b}" for a, b in rows)]) + "\n", encoding="utf-8")
    if command == "show":
        check(["lengths", "--show", path, "--json"])
    else:
        extra = ["--ulysses", "8"] if command == "estimate" else ["--top", "1"]
        check([command, "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--lengths", path, *extra,
               "--json"])


@settings(FUZZ, max_examples=25)
@given(bins=st.one_of(st.lists(st.lists(st.one_of(st.integers(-3, 1 << 62), st.floats(allow_nan=True),
                                                  st.text(max_size=3), st.none()), max_size=3), max_size=4),
                      st.dictionaries(st.text(max_size=4), st.integers(), max_size=3), st.none(), st.integers()),
       fmt=st.sampled_from(["sp-plan-lengths/1", "sp-plan-lengths/2", "", None]))
def test_fuzz_lengths_json(bins, fmt, tmp_path_factory):
    path = tmp_path_factory.mktemp("len") / "lengths.json"
    path.write_text(json.dumps({"format": fmt, "bins": bins}), encoding="utf-8")
    check(["lengths", "--show", path, "--json"], allowed=(0, 2))
    check(["plan", "--model", "qwen3-4b", "--seq-len", "16K", "--gpus", "8", "--top", "1", "--lengths", path,
           "--packing", "sorted", "--sharding", "per_document"], allowed=(0, 1, 2))


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_fuzz_lengths_hostile_files(name, tmp_path):
    for suffix in (".csv", ".json", ".yaml"):
        path = tmp_path / f"{name}{suffix}"
        path.write_bytes(HOSTILE_FILES[name])
        check(["lengths", "--show", path], allowed=(2,))
        check(["plan", "--model", "llama3-8b", "--seq-len", "32K", "--gpus", "8", "--lengths", path], allowed=(2,))
