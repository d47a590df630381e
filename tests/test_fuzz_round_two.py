"""Fuzz round two (issue 35, item 8 and the CI part of "Done when"): inline GPU specs, integers longer than
Python converts, and hostile model names in exports through the CLI; hostile datasets and tokenizer files
into ``sp-plan train``'s data path; hostile plan files into ``sp-plan validate`` on 2 CPU ranks.

The contract is test_fuzz_cli.py's (:func:`tests.test_fuzz_cli.check`): exit 0, 1 or 2, never a traceback,
one line for a refusal, and an exit-0 ``--json`` answer that is strict JSON with finite, sane figures.
Hypothesis is derandomized so CI sees the same examples on every run; the example counts keep the file
near a minute on 2 cores (benchmarks/fuzz_cli.py runs thousands).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sp_plan.cost_models.data import load
from tests.test_fuzz_cli import FUZZ, check

HUGE_INT = "9" * 5000

#: Values a hand-written or generated spec file may hold where a positive physical figure belongs.
physical = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([0, -1, 1e-300, 1e300, 1e17, 1e18, 9.9e14, 3.35e12, "fast", "", None, [1], {"a": 1}, True]),
)
dtype_key = st.sampled_from(["bf16", "fp16", "fp8", "fp32", "tf32", "BF16", "", "bogus", "int8"])


def _strict(stdout: str) -> None:
    json.loads(stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in --json output"))


def _topology(tmp_path: Path, gpu: dict, raw: str | None = None) -> Path:
    spec = {**load("topologies", "dgx-h100"), "name": "fuzzed", "gpu": gpu}
    text = yaml.safe_dump(spec)
    if raw is not None:  # an integer too long for yaml.safe_dump to write from a Python int
        text = text.replace("memory_bandwidth: 3000000000000.0", f"memory_bandwidth: {raw}")
    path = tmp_path / "fuzzed.yaml"
    path.write_text(text)
    return path


@settings(FUZZ, max_examples=40)
@given(flops=st.dictionaries(dtype_key, physical, max_size=3), bandwidth=physical,
       memory=st.one_of(physical, st.just(80 << 30)),
       command=st.sampled_from(["estimate", "topo", "plan"]), huge=st.booleans())
def test_fuzz_inline_gpu_specs(flops, bandwidth, memory, command, huge, tmp_path_factory):
    gpu = {"name": "fuzz-accel", "memory_bytes": memory, "peak_flops": flops,
           "memory_bandwidth": 3.0e12 if huge else bandwidth}
    path = _topology(tmp_path_factory.mktemp("gpu"), gpu, HUGE_INT if huge else None)
    if command == "topo":
        args = ["topo", "show", path, "--json"]
    else:
        args = [command, "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--topology", path, "--json"]
        args += ["--top", "1"] if command == "plan" else ["--ulysses", "8"]
    code, stdout, _ = check(args)
    if code == 0:
        _strict(stdout)


def _numeric_paths(data, path=()):
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numeric_paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _numeric_paths(value, (*path, i))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield path


def _with_huge(document, path, as_json: bool = False) -> str:
    """``document`` as YAML (or JSON) with the number at ``path`` replaced by a 5,000-digit integer."""
    marker = "__HUGE_INTEGER__"
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = marker
    text = json.dumps(document) if as_json else yaml.safe_dump(document)
    return text.replace(f'"{marker}"', HUGE_INT).replace(f"'{marker}'", HUGE_INT).replace(marker, HUGE_INT)


def _planned(root: Path, model: str, seq_len: str, gpus: str) -> dict:
    """The plan document `sp-plan plan` writes for ``model`` (the top layout)."""
    out = root / "plan.yaml"
    code, _, err = check(["plan", "--model", model, "--seq-len", seq_len, "--gpus", gpus, "--top", "1", "--out", out])
    assert code == 0, err
    return yaml.safe_load(out.read_text())


@pytest.fixture(scope="module")
def plan_document(tmp_path_factory) -> dict:
    return _planned(tmp_path_factory.mktemp("plan"), "llama3-8b", "32K", "8")


@settings(FUZZ, max_examples=30)
@given(kind=st.sampled_from(["topology", "plan", "config"]), pick=st.integers(0, 10_000))
def test_fuzz_huge_integers_anywhere(kind, pick, plan_document, tmp_path_factory):
    """A 5,000-digit integer in any numeric field of a topology, plan or config.json: one line, exit 2."""
    import copy

    root = tmp_path_factory.mktemp("huge")
    if kind == "topology":
        document = copy.deepcopy(load("topologies", "dgx-h100"))
    elif kind == "plan":
        document = copy.deepcopy(plan_document)
    else:
        document = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                    "max_position_embeddings": 4096, "rope_theta": 10000.0}
    paths = list(_numeric_paths(document))
    path = root / ("config.json" if kind == "config" else f"{kind}.yaml")
    path.write_text(_with_huge(document, paths[pick % len(paths)], as_json=kind == "config"))
    if kind == "config":
        args = ["estimate", "--model", path, "--seq-len", "8K", "--gpus", "8"]
    elif kind == "topology":
        args = ["estimate", "--model", "llama3-8b", "--seq-len", "8K", "--gpus", "8", "--topology", path]
    else:
        args = ["export", path, "--to", "deepspeed"]
    check(args, allowed=(2,))


#: Names that would be code in a shell, a YAML or JSON document, or a terminal.
name_text = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=40),
    st.sampled_from(["$(touch PWNED)", "`touch PWNED`", "a\ntouch PWNED", "'; touch PWNED; '", '"$(id)"',
                     "x\x00y", "\x1b[31mred", "--help", "-", "a b", "{{x}}", "*", "~root", "!!python/object"]),
)


@settings(FUZZ, max_examples=40)
@given(name=name_text, target=st.sampled_from(["megatron", "torchrun", "accelerate", "deepspeed"]))
def test_fuzz_hostile_model_names_in_exports(name, target, plan_document, tmp_path_factory):
    """Whatever the plan's model name, an export is refused in one line or, for a script, is a script
    ``bash -n`` accepts whose words are what was exported (checked with shlex) and that creates no file."""
    import copy

    root = tmp_path_factory.mktemp("names")
    document = copy.deepcopy(plan_document)
    document["model"]["name"] = name
    plan = root / "plan.yaml"
    plan.write_text(yaml.safe_dump(document))
    code, stdout, _ = check(["export", plan, "--to", target])
    if code != 0 or target not in ("megatron", "torchrun"):
        return
    syntax = subprocess.run(["bash", "-n"], input=stdout, capture_output=True, text=True, timeout=30, check=False)
    assert syntax.returncode == 0, (name, syntax.stderr, stdout[-2000:])
    if target == "torchrun":
        words = shlex.split(stdout)
        assert words[0] == "torchrun" and str(plan) in words, (name, stdout)
    else:  # run it with every command a no-op: nothing it runs may come from the name
        sandbox = root / "sandbox"
        sandbox.mkdir()
        stub = sandbox / "bin"
        stub.mkdir()
        for tool in ("torchrun", "python", "python3", "nvidia-smi"):
            (stub / tool).write_text("#!/bin/sh\nexit 0\n")
            (stub / tool).chmod(0o755)
        env = {"PATH": f"{stub}:/usr/bin:/bin", "HOME": str(sandbox), "NODE_RANK": "0", "MASTER_ADDR": "localhost"}
        subprocess.run(["bash", "-c", stdout], cwd=sandbox, env=env, capture_output=True, text=True, timeout=60,
                       check=False)
        assert not (sandbox / "PWNED").exists(), (name, stdout)


# ----- train: hostile datasets and tokenizer files ----------------------------------------------------------

pytest.importorskip("transformers")
pytest.importorskip("datasets")

DATASETS: dict[str, bytes] = {
    "binary.jsonl": bytes(range(256)) * 64,
    "not-objects.jsonl": b"1\n[2]\n\"three\"\nnull\n",
    "text-is-number.jsonl": b'{"text": 5}\n{"text": 6}\n',
    "text-is-list.jsonl": b'{"text": ["a", "b"]}\n',
    "mixed-types.jsonl": b'{"text": "a"}\n{"text": 7}\n',
    "no-text.jsonl": b'{"body": "x"}\n',
    "deep.jsonl": b'{"text": ' + b"[" * 20000 + b"]" * 20000 + b"}\n",
    "huge-int.jsonl": b'{"text": "x", "n": ' + HUGE_INT.encode() + b"}\n",
    "latin1.jsonl": '{"text": "caf\xe9"}\n'.encode("latin-1"),
    "empty.jsonl": b"",
    "nul.txt": b"\x00" * 4096,
    "garbage.parquet": b"PAR1" + os.urandom(512),
    "garbage.arrow": os.urandom(512),
    "bad.csv": b'text\n"unterminated\n',
}


def _tokenizer_dirs(root: Path, good: Path) -> dict[str, Path]:
    """A good tokenizer directory and hostile variants of it."""
    out = {}

    def variant(name: str, **files: bytes) -> None:
        path = root / name
        path.mkdir()
        for item in good.iterdir():
            (path / item.name).write_bytes(item.read_bytes())
        for file, content in files.items():
            (path / file.replace("__", ".")).write_bytes(content)
        out[name] = path

    variant("garbage-json", tokenizer__json=b"{not json")
    variant("binary-json", tokenizer__json=bytes(range(256)))
    variant("deep-json", tokenizer__json=b"[" * 100_000 + b"]" * 100_000)
    variant("remote-code", tokenizer_config__json=json.dumps(
        {"tokenizer_class": "Evil", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}).encode())
    variant("unknown-class", tokenizer_config__json=b'{"tokenizer_class": "NoSuchTokenizerAnywhere"}')
    variant("huge-int", tokenizer_config__json=b'{"model_max_length": ' + HUGE_INT.encode() + b"}")
    empty = root / "empty-dir"
    empty.mkdir()
    out["empty-dir"] = empty
    (root / "a-file").write_bytes(b"\x00\x01")
    out["a-file"] = root / "a-file"
    return out


@pytest.fixture(scope="module")
def data_inputs(tmp_path_factory):
    from sp_plan.runtime.text_data import build_bpe_tokenizer

    root = tmp_path_factory.mktemp("hostile-data")
    good = root / "tokenizer"
    build_bpe_tokenizer([f"def f{i}(x):\n    return x * {i}\n" for i in range(200)], good, vocab_size=300)
    for name, content in DATASETS.items():
        (root / name).write_bytes(content)
    (root / "good.jsonl").write_text("".join(json.dumps({"text": f"x = {i} * y\n" * 20}) + "\n" for i in range(200)))
    return root, good, _tokenizer_dirs(root, good)


def _packs_or_one_line(source: Path, tokenizer: Path, root: Path) -> str:
    """Pack ``source`` with ``tokenizer`` as sp-plan train does: only a one-line RuntimeConfigError may escape."""
    from sp_plan.runtime.errors import RuntimeConfigError
    from sp_plan.runtime.text_data import PackedTextDataset

    marker = root / "PWNED"
    try:
        PackedTextDataset.build(str(source), str(tokenizer), 64, cache_dir=root / "packed", hf_cache_dir=root / "hf")
    except RuntimeConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message, message
        return message
    finally:
        assert not marker.exists()
    return ""


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_hostile_datasets_are_one_line(name, data_inputs):
    root, good, _ = data_inputs
    assert _packs_or_one_line(root / name, good, root), f"{name} was packed without a word"


@pytest.mark.parametrize("name", ["garbage-json", "binary-json", "deep-json", "remote-code", "unknown-class",
                                  "huge-int", "empty-dir", "a-file"])
def test_hostile_tokenizer_files_are_one_line(name, data_inputs):
    root, _, tokenizers = data_inputs
    message = _packs_or_one_line(root / "good.jsonl", tokenizers[name], root)
    if name in ("huge-int",):  # transformers reads a long model_max_length as a number: packing may go on
        return
    assert message, f"tokenizer {name} was loaded without a word"


BIN = Path(sys.executable).parent


@pytest.mark.parametrize(("dataset", "tokenizer"), [("binary.jsonl", None), ("good.jsonl", "remote-code")])
def test_train_console_script_refuses_hostile_data_in_one_line(dataset, tokenizer, data_inputs):
    root, good, tokenizers = data_inputs
    tok = tokenizers[tokenizer] if tokenizer else good
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SP_PLAN_CACHE": str(root / "cache")}
    done = subprocess.run([str(BIN / "sp-plan"), "train", "--dataset", str(root / dataset), "--tokenizer", str(tok),
                           "--seq-len", "64", "--steps", "1", "--no-progress", "--yes"], capture_output=True,
                          text=True, timeout=240, check=False, cwd=root, env=env)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    return errors[0]


# ----- validate: hostile plans on 2 CPU ranks -----------------------------------------------------------------


def _edited_plan(plan_document: dict, root: Path, edit: str) -> Path:
    import copy

    document = copy.deepcopy(plan_document)
    if edit == "world-8-on-2":
        pass  # the plan is for 8 GPUs: 2 ranks must be refused before any model is built
    elif edit == "huge-model":
        document["model"].update(num_layers=10_000, hidden_size=1 << 16, ffn_hidden_size=1 << 18)
    path = root / f"{edit}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def two_gpu_plan(tmp_path_factory) -> dict:
    return _planned(tmp_path_factory.mktemp("plan2"), "qwen3-4b", "4K", "2")


@pytest.mark.multiproc
@pytest.mark.parametrize(("edit", "said"), [("world-8-on-2", "plan needs 8 ranks"), ("huge-model", "host RAM")])
def test_validate_refuses_hostile_plans_on_cpu_ranks(edit, said, plan_document, two_gpu_plan, tmp_path):
    """Was: the whole model built first on every rank, then the OOM killer (8B on 2 CPU ranks) or an
    allocator traceback (a 10,000-layer model)."""
    path = _edited_plan(plan_document if edit == "world-8-on-2" else two_gpu_plan, tmp_path, edit)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "sp_plan.cli",
                           "validate", "--plan", str(path), "--steps", "1"], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and all(said in line for line in errors), out[-3000:]
