"""Progress inside a step of many micro-batches: ``train_step`` reports each micro-batch done, and the
trainer's telemetry shows "micro-batch k of n" (at most every ``MICRO_BATCH_REPORT_S`` seconds) so a
run of minutes-long steps does not look hung."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.test_checkpoint import configure, trainer_for


def _progress_rank(rank: int, world: int, report_s: float) -> dict:
    from sp_plan.runtime import trainer as trainer_module
    from sp_plan.runtime.step import train_step
    from sp_plan.runtime.text_data import GlobalBatches
    from tests.test_checkpoint import dataset

    trainer_module.MICRO_BATCH_REPORT_S = report_s
    setup = configure({}, {"zero_stage": 3}, global_batch=4)
    calls: list[tuple[int, int]] = []
    batches = GlobalBatches.for_setup(setup, dataset(), seed=1).next_step()
    train_step(setup, batches, None, on_micro_batch=lambda k, n: calls.append((k, n)))
    lines: list[str] = []
    trainer_for(setup, steps=2, log_every=1, print_fn=lines.append).fit()
    return {"calls": calls, "grad_accum": setup.train.grad_accum, "lines": lines}


@pytest.mark.multiproc
def test_each_micro_batch_is_reported_and_shown_inside_the_step():
    out = run_ranks(1, _progress_rank, 0.0, timeout=180)[0]
    n = out["grad_accum"]
    assert n == 4
    assert out["calls"] == [(k, n) for k in range(1, n + 1)]
    progress = [ln for ln in out["lines"] if ": micro-batch " in ln]
    # every micro-batch but the last (the step's own line follows at once), in both steps, in order
    assert [ln.split(" after ")[0] for ln in progress] == [f"step {s}: micro-batch {k}/{n}" for s in (1, 2)
                                                         for k in range(1, n)]
    first_step_line = next(i for i, ln in enumerate(out["lines"]) if ln.startswith("step 1 |"))
    assert out["lines"].index(progress[n - 2]) < first_step_line


@pytest.mark.multiproc
def test_short_steps_show_no_micro_batch_progress():
    out = run_ranks(1, _progress_rank, 3600.0, timeout=180)[0]
    assert not [ln for ln in out["lines"] if "micro-batch" in ln]
    assert any(ln.startswith("step 2 |") for ln in out["lines"])
