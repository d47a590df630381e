"""What a user installs: one import name, ``sp_plan``, that works outside the source tree.

The layers are mapped from the repository's top-level folders in pyproject.toml, with every package
listed by hand; a folder missing from that list would be left out of the wheel silently, so the list is
checked against the folders, and a real wheel is built, unpacked and run from elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _folder_of(package: str) -> Path:
    """The source folder setuptools takes a package from (the longest mapped prefix)."""
    mapping = SETUPTOOLS["package-dir"]
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return ROOT / mapping[prefix] / Path(*parts[cut:])
    raise AssertionError(f"{package} is under no package-dir mapping")


def test_the_package_list_names_every_package_folder():
    listed = {_folder_of(p).resolve() for p in SETUPTOOLS["packages"]}
    on_disk = {init.parent.resolve() for folder in set(SETUPTOOLS["package-dir"].values())
               for init in (ROOT / folder).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert on_disk - listed == set(), "package folders missing from [tool.setuptools] packages"
    assert listed - on_disk == set(), "listed packages without a folder"


def test_the_console_script_points_into_sp_plan():
    assert PYPROJECT["project"]["scripts"] == {"sp-plan": "sp_plan.cli.main:main"}


#: Never part of a build: environments, caches, and earlier build output (setuptools' build/lib keeps files
#: deleted since, which would then ship).
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                    ".pytest_cache")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a clean copy of the tree, as a fresh clone would build it."""
    source = tmp_path_factory.mktemp("source") / "sp-plan"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "No matching distribution found for setuptools" in done.stderr:
        pytest.skip("no package index reachable to build the wheel's build environment")
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("sp_plan-*.whl")
    return path


def test_the_wheel_installs_only_sp_plan(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"sp_plan"}
    for folder in ("cost_models", "planner", "runtime", "cli"):
        sources = {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
        packed = {name.removeprefix("sp_plan/") for name in names if name.startswith(f"sp_plan/{folder}/")}
        packed = {name for name in packed if name.endswith(".py")}
        assert sources == packed, (f"{folder}: missing from the wheel {sorted(sources - packed)[:5]}, "
                                   f"in the wheel without a source {sorted(packed - sources)[:5]}")
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "cost_models" / "data").rglob("*.yaml")}
    assert shipped and shipped <= {name.removeprefix("sp_plan/") for name in names}


def test_the_unpacked_wheel_plans_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import sys, sp_plan.cost_models, sp_plan.planner, sp_plan.cli.main as m; "
            "print(sp_plan.planner.__file__); print('torch' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    location, torch_loaded = shown.stdout.split()
    assert Path(location).is_relative_to(site) and torch_loaded == "False"
    done = subprocess.run([sys.executable, "-m", "sp_plan.cli", "estimate", "--model", "llama3-8b", "--seq-len", "32K",
                           "--gpus", "8", "--ulysses", "8", "--json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"fits"' in done.stdout
