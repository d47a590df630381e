"""``sp-plan capacity --sweep``: every row carries the trust band a single answer carries (issue 33 item 1).

JSON: an ``uncertainty`` object per row with a plan, as ``capacity --seq-len`` writes one; text: the figures
rounded to the band, the band stated once under the table when every row has the same one, else a column keyed
to footnotes. Through the console script, as a user runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sp_plan.cost_models import Layout, TrainSpec, get_model_preset
from sp_plan.planner.band_report import CALIBRATE_HINT, bands_json, prediction_bands

SP_PLAN = str(Path(sys.executable).with_name("sp-plan"))
#: A short, a long and an impossible point: two regimes (<64K, >=64K) and a row without a plan.
SEQ_SWEEP = ["capacity", "--model", "llama3-8b", "--gpus", "8", "--sweep", "seq=16K,128K,16M"]


def _run(*args: str) -> str:
    done = subprocess.run([SP_PLAN, *args], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_sweep_row_with_a_plan_has_the_band_of_its_own_regime_in_json():
    rows = json.loads(_run(*SEQ_SWEEP, "--json"))["sweep"]
    model = get_model_preset("llama3-8b")
    assert [r["plan"] is not None for r in rows] == [True, True, False]
    assert "uncertainty" not in rows[2]  # no plan, no prediction, no band
    for row in rows[:2]:
        layout = Layout(**row["plan"]["layout"])
        expected = prediction_bands(model, TrainSpec(seq_len=row["seq_len"]), layout, gpu="h100-80gb",
                                    stack="sp-plan", quantities=("memory", "step_time"))
        assert row["uncertainty"] == json.loads(json.dumps(bands_json(expected)))
        assert row["uncertainty"]["step_time"]["one_sigma"] > 0
    assert "<64K" in json.dumps(rows[0]["uncertainty"]) and ">=64K" in json.dumps(rows[1]["uncertainty"])


def test_rows_whose_bands_differ_get_a_band_column_keyed_to_footnotes():
    out = _run(*SEQ_SWEEP).splitlines()
    header = next(line for line in out if line.startswith("GPUs"))
    assert header.rstrip().endswith("+/- (1 sigma)")
    short, long_ = (next(line for line in out if line.split()[:2] == ["8", seq]) for seq in ("16K", "128K"))
    assert short.rstrip().endswith("[a]") and long_.rstrip().endswith("[b]") and "step +/-" in short
    notes = {line[:3]: line for line in out if line.startswith(("[a]", "[b]"))}
    assert "<64K" in notes["[a]"] and ">=64K" in notes["[b]"] and "1 sigma" in notes["[a]"]
    assert out[-1] == CALIBRATE_HINT


def test_rows_that_share_one_band_state_it_once_under_the_table():
    out = _run("capacity", "--model", "llama3-8b", "--seq-len", "32K", "--sweep", "gpus=8,16").splitlines()
    assert "+/-" not in next(line for line in out if line.startswith("GPUs"))
    trust = [line for line in out if line.startswith("trust (every row): ")]
    assert len(trust) == 1 and "step, tokens/s, MFU +/-" in trust[0] and "; memory +/-" in trust[0]
    rows = [line for line in out if line.split()[:1] in (["8"], ["16"])]
    assert len(rows) == 2 and all(" s " in r and r.rstrip().endswith("%") for r in rows)
