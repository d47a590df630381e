"""``--lengths`` without ``--packing``: the planner searches the packing with the layout (issue 32 item 2), picks
the fastest plan in useful tokens/s over the packings, says so, and the plan file carries what it chose."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from sp_plan.cli.main import main
from sp_plan.cost_models.data_balance import AUTO_PACKINGS, DataShape, auto_packings
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.lengths import histogram_from_lengths
from sp_plan.cost_models.model_spec import load_model
from sp_plan.cost_models.topology import load_topology
from sp_plan.cost_models.train_spec import TrainSpec
from sp_plan.planner.plan import load_plan
from sp_plan.planner.search import PlanSettings, search

#: A small long-tailed set: many short documents and a few of a whole row and more (cheap to pack).
BINS = histogram_from_lengths([300] * 400 + [2000] * 60 + [9000] * 8 + [40000] * 2).bins
SEQ = 16384


def _train(packing: str, sharding: str = "auto") -> TrainSpec:
    return TrainSpec(seq_len=SEQ, data=DataShape(bins=BINS, packing=packing, sharding=sharding))


def test_auto_is_the_best_of_searching_each_packing_alone():
    model, topology = load_model("qwen3-4b"), load_topology("dgx-h100", 8)
    settings = PlanSettings(top_k=3, global_batch_tokens=1 << 20)
    auto = search(model, _train("auto"), topology, settings).best
    fixed = {p: search(model, _train(p), topology, settings).best for p in AUTO_PACKINGS}
    winner = min(fixed, key=lambda p: fixed[p].score)
    assert auto.score == pytest.approx(fixed[winner].score, rel=1e-12)
    assert auto.train.data.packing == winner and auto.train.data.packing_auto
    assert auto.estimate.time.tokens_per_s == pytest.approx(fixed[winner].estimate.time.tokens_per_s, rel=1e-12)


def test_an_auto_shape_is_never_priced_and_auto_keeps_documents_whole():
    shape = DataShape(bins=BINS, packing="auto")
    with pytest.raises(CostModelError, match="packing 'auto' is chosen by the planner's search"):
        shape.rows(SEQ)
    tried = auto_packings(shape)
    assert [s.packing for s in tried] == list(AUTO_PACKINGS) and all(s.packing_auto for s in tried)
    assert "stream" not in AUTO_PACKINGS  # it cuts documents: the user's choice, not a speed-up
    # a search-chosen stream shape (if auto ever tries it) is split zigzag only: per-document sharding lengthens
    # stream rows in the runtime
    stream = DataShape(bins=BINS, packing="stream", packing_auto=True)
    assert stream.auto_rules(4) == ("zigzag",) and stream.runs_at(4)
    pinned = stream.model_copy(update={"sharding": "per_document"})
    assert not pinned.runs_at(4) and pinned.runs_at(1)
    # an explicit --packing stream keeps both runtime rules under auto sharding
    assert DataShape(bins=BINS, packing="stream").auto_rules(4) == ("zigzag", "per_document")
    assert auto_packings(DataShape(bins=BINS, packing="sorted")) == (DataShape(bins=BINS, packing="sorted"),)


BASE = ["--model", "qwen3-4b", "--seq-len", "16K", "--gpus", "8"]
BATCH = ["--global-batch-tokens", "1M"]


def _cli(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(args)
        except SystemExit as exc:
            assert not exc.code, out.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def lengths(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto-packing") / "lengths.csv"
    path.write_text("length,count\n" + "".join(f"{length},{count}\n" for length, count in BINS))
    return str(path)


def test_the_report_and_json_say_auto_chose_the_packing_and_a_pin_still_pins(lengths):
    plan = json.loads(_cli(["plan", *BASE, *BATCH, "--lengths", lengths, "--top", "1", "--json"]))["plans"][0]["data"]
    assert plan["packing_requested"] == "auto" and plan["packing"] in AUTO_PACKINGS
    pinned = json.loads(_cli(["plan", *BASE, *BATCH, "--lengths", lengths, "--packing", "sorted", "--top", "1",
                              "--json"]))
    assert pinned["plans"][0]["data"]["packing"] == pinned["plans"][0]["data"]["packing_requested"] == "sorted"
    text = _cli(["estimate", *BASE, "--ulysses", "8", "--lengths", lengths])
    assert "(chosen by auto) into 16K-token rows" in text


def test_explain_marks_the_chosen_packing_and_says_what_it_is_worth(lengths):
    text = _cli(["estimate", *BASE, "--ulysses", "4", "--ring", "2", "--lengths", lengths, "--json"])
    chosen = json.loads(text)["data"]
    out = _cli(["plan", *BASE, *BATCH, "--ulysses", "4", "--ring", "2", "--lengths", lengths, "--top", "1",
                "--explain"])
    table = [line for line in out.splitlines() if line.startswith("   ")]
    marked = [line for line in table if line.lstrip().startswith("*")]
    assert len(marked) == 1 and f" {chosen['sharding']} " in marked[0] and f" {chosen['packing']} " in marked[0]
    worth = [line for line in out.splitlines() if line.startswith(f"  packing {chosen['packing']} (chosen by auto)")]
    assert len(worth) == 1 and "faster than the other packings at this layout by: " in worth[0]
    assert any(line.startswith("  ") and "ring imbalance" in line for line in out.splitlines())


def test_the_plan_file_carries_the_chosen_packing_for_train(lengths, tmp_path):
    from sp_plan.runtime.train_options import TrainRunOptions
    from sp_plan.runtime.train_run import dataset_packing

    out = tmp_path / "plan.yaml"
    report = json.loads(_cli(["plan", *BASE, *BATCH, "--lengths", lengths, "--top", "1", "--json", "--out", str(out)]))
    chosen = report["plans"][0]["data"]["packing"]
    plan = load_plan(out)
    assert plan.train.data.packing == chosen and plan.train.data.packing_auto
    # train --plan without --packing packs as the plan chose; --packing still overrides it
    assert dataset_packing(TrainRunOptions(dataset="d", tokenizer="t"), plan) == chosen
    assert dataset_packing(TrainRunOptions(dataset="d", tokenizer="t", packing="sorted"), plan) == "sorted"
