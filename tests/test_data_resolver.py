"""The one data resolver (issue 18): every shipped file is reached through ``sp_plan.cost_models.data``, one
file per entity, one rule telling a shipped name from a user's file, one size bound, clear errors."""

import fnmatch
import json
import pathlib

import pytest

from sp_plan.cost_models import CostModelError, data, get_gpu_preset, get_model_preset, load_model
from sp_plan.cost_models.gpu_spec import canonical_gpu_name, gpu_aliases, gpu_preset_names
from sp_plan.cost_models.model_spec import model_preset_names
from sp_plan.cost_models.stack import load_stack, stack_names
from sp_plan.cost_models.topology import get_preset_spec, load_topology, preset_names

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "cost_models" / "data"
#: Every model and GPU preset as the combined models.yaml / gpus.yaml defined them before the split
#: (recorded from those files, then committed): the split must not move a single value.
BEFORE_SPLIT = json.loads((ROOT / "tests" / "data" / "shipped_presets.json").read_text())
USER_FILE_KINDS = ("models", "stacks", "topologies")


def _on_disk(kind: str) -> set[str]:
    return {p.stem for p in (DATA / kind).glob("*.yaml") if not p.name.startswith("_")}


# ----- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(data.KINDS))
def test_names_list_every_shipped_entity(kind):
    assert set(data.names(kind)) == _on_disk(kind) and len(data.names(kind)) > 0
    assert list(data.names(kind)) == sorted(data.names(kind))
    assert not any(name.startswith("_") for name in data.names(kind))  # _fabrics.yaml is a helper


def test_the_public_listings_are_the_resolvers():
    assert model_preset_names() == list(data.names("models")) == sorted(BEFORE_SPLIT["models"])
    assert gpu_preset_names() == list(data.names("gpus")) == sorted(BEFORE_SPLIT["gpus"])
    assert list(stack_names()) == sorted(_on_disk("stacks"))
    assert preset_names() == sorted(_on_disk("topologies"))


def test_the_combined_files_are_gone():
    assert not (DATA / "models.yaml").exists() and not (DATA / "gpus.yaml").exists()
    assert not list(DATA.glob("*.yaml"))  # every data file lives in its kind's folder


def test_an_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="no data kind 'model'"):
        data.names("model")


# ----- every preset keeps its values --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BEFORE_SPLIT["models"]))
def test_every_model_preset_loads_with_the_same_values(name):
    model = get_model_preset(name)
    expected = BEFORE_SPLIT["models"][name]
    assert model.model_dump(mode="json") == {k: v for k, v in expected.items() if k != "num_params"}
    assert model.num_params == expected["num_params"]


@pytest.mark.parametrize("name", sorted(BEFORE_SPLIT["gpus"]))
def test_every_gpu_preset_loads_with_the_same_values(name):
    assert get_gpu_preset(name).model_dump(mode="json") == BEFORE_SPLIT["gpus"][name]


def test_every_alias_still_resolves_to_the_same_entity():
    assert data.aliases("models") == BEFORE_SPLIT["model_aliases"]
    assert data.aliases("gpus") == gpu_aliases() == BEFORE_SPLIT["gpu_aliases"]
    for alias, name in BEFORE_SPLIT["model_aliases"].items():
        assert get_model_preset(alias.upper()) == get_model_preset(name)
        assert load_model(alias).name == name
    for alias, name in BEFORE_SPLIT["gpu_aliases"].items():
        assert get_gpu_preset(f" {alias} ") == get_gpu_preset(name)
        assert canonical_gpu_name(alias) == name


def test_an_alias_lives_in_its_entitys_file():
    """A new model or GPU is one file: its other names are declared in it, not in a shared table."""
    for kind, table in (("models", BEFORE_SPLIT["model_aliases"]), ("gpus", BEFORE_SPLIT["gpu_aliases"])):
        for alias, name in table.items():
            assert alias in data.load(kind, name)["aliases"], (kind, alias)


def test_a_name_declared_twice_is_refused(monkeypatch):
    files = {"a": {"aliases": ["x"]}, "b": {"aliases": ["X"]}}
    monkeypatch.setattr(data, "names", lambda kind: tuple(files))
    monkeypatch.setattr(data, "load", lambda kind, name: files[name])
    with pytest.raises(CostModelError, match="alias 'x' of b is already a name or an alias"):
        data.aliases.__wrapped__("models")
    files["b"] = {"aliases": ["a"]}  # an alias that is another file's name
    with pytest.raises(CostModelError, match="alias 'a' of b"):
        data.aliases.__wrapped__("models")


# ----- one rule: a shipped name or a user's file ---------------------------------------------------------


def test_a_shipped_name_resolves_case_insensitively():
    assert data.resolve("models", " Llama3.1-8B ") == data.Resolved("models", name="llama3-8b")
    assert data.resolve("stacks", "TorchTitan").name == "torchtitan"
    assert data.resolve("topologies", "DGX-H100").name == "dgx-h100"
    assert data.resolve("gpus", "H100-SXM").name == "h100-80gb"
    assert load_stack("TorchTitan").name == "torchtitan"


@pytest.mark.parametrize("kind, file_name, text", [
    ("models", "config.json", '{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, '
                              '"num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000}'),
    ("stacks", "mine.yaml", "name: mine\n"),
    ("topologies", "node.yml", "name: x\n"),
])
def test_a_path_resolves_to_the_users_file(kind, file_name, text, tmp_path, monkeypatch):
    path = tmp_path / file_name
    path.write_text(text)
    assert data.resolve(kind, str(path)) == data.Resolved(kind, path=path)
    monkeypatch.chdir(tmp_path)
    assert data.resolve(kind, file_name).path == pathlib.Path(file_name)  # the suffix says "a file"
    assert data.is_user_file(kind, file_name)
    assert data.read_user_text(kind, file_name) == text


def test_loaders_read_a_users_file(tmp_path):
    stack = tmp_path / "mine.yaml"
    stack.write_text("name: mine\ntime: {layer_overhead_s: 0.001}\n")
    assert load_stack(str(stack)).time.layer_overhead_s == 0.001
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
        "intermediate_size": 512, "vocab_size": 1000}))
    assert load_model(str(folder)).num_layers == 2


def test_a_bare_shipped_name_wins_over_a_file_of_that_name(tmp_path, monkeypatch):
    """Rule 2 before rule 3: ``torchtitan`` is the shipped stack even beside a torchtitan checkout; write
    ``./torchtitan`` for the folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torchtitan").mkdir()
    (tmp_path / "llama3-8b").mkdir()
    assert data.resolve("stacks", "torchtitan").name == "torchtitan"
    assert data.resolve("models", "llama3-8b").name == "llama3-8b"
    assert data.resolve("models", "./llama3-8b").path == pathlib.Path("./llama3-8b")


def test_a_bare_name_that_only_exists_on_disk_is_a_users_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-stack").write_text("name: my-stack\n")
    assert data.resolve("models", "my-model").path == pathlib.Path("my-model")
    assert load_stack("my-stack").name == "my-stack"


def test_gpus_take_shipped_names_only(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text("memory_bytes: 1\n")
    with pytest.raises(CostModelError, match="unknown GPU"):
        data.resolve("gpus", str(path))
    assert not data.is_user_file("gpus", str(path))


# ----- clear errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, typo, suggestion, call", [
    ("models", "lama3-70b", "llama3-70b", get_model_preset),
    ("models", "qwen3-8", "qwen3-8b", load_model),
    ("gpus", "h100-80g", "h100-80gb", get_gpu_preset),
    ("stacks", "torchtitn", "torchtitan", load_stack),
    ("topologies", "dgx-h10", "dgx-h100", get_preset_spec),
    ("topologies", "dgx-h10", "dgx-h100", lambda ref: load_topology(ref, 8)),
])
def test_an_unknown_name_gets_the_closest_names(kind, typo, suggestion, call):
    with pytest.raises(CostModelError) as err:
        call(typo)
    message = str(err.value)
    assert message.startswith(f"unknown {data.KINDS[kind].what} {typo!r}: did you mean {suggestion}")
    assert ", ".join(data.names(kind)) in message and "\n" not in message


def test_an_unknown_name_without_a_close_one_lists_the_choices():
    message = str(data.unknown_name("stacks", "zzzz"))
    assert "did you mean" not in message
    assert message == f"unknown stack 'zzzz': choose one of {', '.join(stack_names())} or give a stack YAML file"


def test_an_unknown_shipped_file_name_is_refused():
    with pytest.raises(CostModelError, match="unknown calibration data file 'publshed': did you mean published"):
        data.read_text("calibration", "publshed")


@pytest.mark.parametrize("kind", USER_FILE_KINDS)
def test_a_missing_user_file_is_refused(kind, tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(CostModelError, match="not found: the file does not exist"):
        data.read_user_text(kind, missing)


@pytest.mark.parametrize("kind, name, load", [
    ("models", "config.json", load_model),
    ("stacks", "big.yaml", load_stack),
    ("topologies", "big.yaml", load_topology),
])
def test_an_oversize_user_file_is_refused_before_it_is_read(kind, name, load, tmp_path):
    path = tmp_path / name
    path.write_bytes(b"#" * (data.MAX_USER_FILE_BYTES + 1))
    with pytest.raises(CostModelError, match=r"is larger than 1 MiB, which no .* is") as err:
        load(str(path))
    assert str(path) in str(err.value)
    path.write_bytes(b"#" * data.MAX_USER_FILE_BYTES)  # at the bound: read (and then refused as content)
    assert data.read_user_text(kind, path) == "#" * data.MAX_USER_FILE_BYTES


@pytest.mark.parametrize("kind, name, load", [
    ("models", "config.json", load_model),
    ("stacks", "latin.yaml", load_stack),
    ("topologies", "latin.yaml", load_topology),
])
def test_a_non_utf8_user_file_is_refused(kind, name, load, tmp_path):
    path = tmp_path / name
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(CostModelError, match="is not a UTF-8 text file: invalid continuation byte at byte 9"):
        load(str(path))


# ----- one place opens the package's data ----------------------------------------------------------------


def test_only_the_resolver_opens_the_packaged_data():
    users = sorted(
        str(path.relative_to(ROOT))
        for folder in ("cost_models", "planner", "runtime", "cli")
        for path in (ROOT / folder).rglob("*.py")
        if "resources.files" in path.read_text() or "import resources" in path.read_text()
    )
    assert users == ["cost_models/data/__init__.py"]


def test_every_shipped_file_is_a_mapping_and_packaged():
    """Each entity file parses, and pyproject's package-data patterns ship it (a wheel without a new
    folder's files would fail only after installation)."""
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "sp_plan.cost_models.data"]
    for kind in data.KINDS:
        for path in (DATA / kind).glob("*.yaml"):
            assert isinstance(data.load(kind, path.stem), dict)
            relative = path.relative_to(DATA).as_posix()
            assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative
