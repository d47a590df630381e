"""Checkpoint and resume across a change of pipeline degree, through the Trainer (tests/test_checkpoint.py's runs).

Each pipeline stage saves its own parameters and optimizer states under the unsplit model's names, so a
checkpoint does not depend on pp: a run at pp=2 (2 gloo ranks, 1F1B, the plan's 2 micro-batches per step) and
one in a single process train the same 4 steps (losses within 1e-4); the pp=2 checkpoint of step 2 resumes in a
single process and the single-process checkpoint resumes at pp=2, each continuing the other's loss curve
(within 1e-4) to the same final weights (the merged pp=2 checkpoint holds every parameter).
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_ranks
from tests.test_checkpoint import SAVE_AT, STEPS, _train_runs

pytestmark = pytest.mark.multiproc

LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-5


def _run(name: str, pp: int, directory: str, resume: str | None = None) -> dict:
    run = {"name": name, "layout": {"pp": pp} if pp > 1 else {}, "options": {"zero_stage": 3}, "global_batch": 2,
           "dir": directory}
    if resume is not None:
        run["resume"] = resume
    return run_ranks(pp, _train_runs, [run], timeout=240)[0][name]


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("pp-resume"))
    single = _run("single", 1, f"{root}/single")
    pipelined = _run("pp2", 2, f"{root}/pp2")
    to_single = _run("pp2->1", 1, f"{root}/to-single", resume=_step_dir(f"{root}/pp2", SAVE_AT))
    to_pipeline = _run("1->pp2", 2, f"{root}/to-pp2", resume=_step_dir(f"{root}/single", SAVE_AT))
    return {"root": root, "single": single, "pp2": pipelined, "pp2->1": to_single, "1->pp2": to_pipeline}


def test_pipelined_training_through_the_trainer_equals_one_process(runs) -> None:
    single, pipelined = runs["single"], runs["pp2"]
    assert pipelined["layout"] == "pp=2" and pipelined["grad_accum"] == single["grad_accum"] == 2
    assert len(pipelined["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(pipelined["losses"], single["losses"], strict=True)) < LOSS_TOL


@pytest.mark.parametrize(("name", "source", "directory"), [("pp2->1", "pp2", "to-single"),
                                                              ("1->pp2", "single", "to-pp2")])
def test_resume_across_a_change_of_pp_continues_to_the_same_weights(runs, name, source, directory) -> None:
    from sp_plan.runtime.checkpoint import load_full_state_dict

    got, want = runs[name], runs[source]
    assert got["start"] == SAVE_AT
    diffs = [abs(a - b) for a, b in zip(got["losses"], want["losses"][SAVE_AT:], strict=True)]
    assert len(diffs) == STEPS - SAVE_AT and max(diffs) < LOSS_TOL, (want["losses"], got["losses"])
    final = load_full_state_dict(_step_dir(f"{runs['root']}/{directory}", STEPS))
    reference = load_full_state_dict(_step_dir(f"{runs['root']}/{source}", STEPS))
    assert sorted(final) == sorted(reference) and len(final) > 0
    worst = max((final[k] - reference[k]).abs().max().item() for k in reference)
    assert worst < WEIGHT_TOL, worst
