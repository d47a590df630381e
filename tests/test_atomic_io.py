"""Outputs are written whole or not at all."""

from __future__ import annotations

import os

import pytest

from sp_plan.cost_models.atomic_io import atomic_output, atomic_write_text
from sp_plan.cost_models.errors import CostModelError


def test_write_replaces_whole_file(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("old")
    atomic_write_text(target, "new content")
    assert target.read_text() == "new content"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_failure_inside_block_keeps_previous_file(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("complete previous plan")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as handle:
            handle.write("half a pl")
            raise RuntimeError("crash mid-write")
    assert target.read_text() == "complete previous plan"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_missing_directory_is_one_clear_error(tmp_path):
    with pytest.raises(CostModelError, match="does not exist"):
        atomic_write_text(tmp_path / "nope" / "plan.yaml", "x")


def test_new_file_gets_umask_permissions(tmp_path):
    target = tmp_path / "out.json"
    atomic_write_text(target, "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
