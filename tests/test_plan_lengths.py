"""Planning from the user's data (issue 32): ``--lengths`` on plan and estimate, through the CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from sp_plan.cli.main import main

BASE = ["--model", "llama3-8b", "--seq-len", "128K", "--gpus", "16"]


def exit_code(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as exc:
        return exc.code or 0
    return 0


def run_json(args: list[str], capsys) -> dict:
    code = exit_code([*args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def sp_degree(plan: dict) -> int:
    layout = plan["layout"]
    return layout["ulysses"] * layout["ring"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The best plan with no data, short SFT data, long documents, and one 128K document per row (CSV)."""
    one_per_row = tmp_path_factory.mktemp("lengths") / "one-per-row.csv"
    one_per_row.write_text("length,count\n131072,5000\n")
    out = {}
    for name, extra in (("none", []), ("short", ["--lengths", "sft-short"]), ("long", ["--lengths", "long-doc-mix"]),
                        ("one", ["--lengths", str(one_per_row)])):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert exit_code(["plan", *BASE, *extra, "--top", "2", "--json"]) == 0
        out[name] = json.loads(buffer.getvalue())["plans"][0]
    return out


def test_the_answer_follows_the_data(plans):
    """Short documents need little attention: less sequence parallelism and more tokens/s than long ones."""
    short, long = plans["short"], plans["long"]
    assert long["layout"] != short["layout"] and sp_degree(long) >= sp_degree(short)
    assert short["time"]["tokens_per_s"] > 1.5 * long["time"]["tokens_per_s"]
    assert plans["none"]["time"]["tokens_per_s"] < long["time"]["tokens_per_s"]
    data = long["data"]
    assert data["sharding"] in ("zigzag", "per_document") and data["attention_factor"] >= 1.0
    assert 0 <= data["padding_fraction"] < 0.05
    assert data["pairs_per_row"]["max"] >= data["pairs_per_row"]["p95"] >= data["pairs_per_row"]["mean"] > 0


def test_one_document_per_row_prices_as_plain_full_sequences(plans):
    """A distribution of whole-row documents is the planner's old assumption: the same plan and step."""
    plain, one = plans["none"], plans["one"]
    assert one["layout"] == plain["layout"]
    assert one["time"]["step_s"] == pytest.approx(plain["time"]["step_s"], rel=1e-9)
    assert one["data"]["equivalent_document_length"] is None and one["data"]["padding_fraction"] == 0.0


def test_per_document_sharding_beats_zigzag_on_long_tailed_rows(capsys):
    layout = ["--ring", "4", "--ulysses", "4", "--lengths", "long-doc-mix", "--packing", "stream"]
    zigzag = run_json(["estimate", *BASE, *layout, "--sharding", "zigzag"], capsys)
    per_doc = run_json(["estimate", *BASE, *layout, "--sharding", "per_document"], capsys)
    assert zigzag["data"]["ring_imbalance"] > 1.2
    assert per_doc["data"]["ring_imbalance"] == pytest.approx(1.0)
    assert per_doc["time"]["step_s"] < zigzag["time"]["step_s"]
    auto = run_json(["estimate", *BASE, *layout], capsys)
    assert auto["data"]["sharding"] == "per_document"


def test_explain_prices_every_rule_and_packing_at_the_chosen_layout(capsys):
    assert exit_code(["plan", *BASE, "--lengths", "long-doc-mix", "--top", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "data: " in out and "balance: " in out and "busiest ring rank" in out
    table = [line for line in out.splitlines() if line.strip().startswith(("*", "zigzag", "per_document", "contiguous"))]
    assert sum(line.lstrip().startswith("*") for line in table) == 1


@pytest.mark.parametrize("flags, named", [
    (["--packing", "sorted"], "--packing"),
    (["--sharding", "per_document"], "--sharding"),
    (["--lengths", "sft-short", "--document-length", "4K"], "--document-length and --lengths"),
])
def test_data_flags_that_contradict_are_refused(flags, named, capsys):
    err = refused(["estimate", *BASE, "--ulysses", "8", *flags], capsys)
    assert named in err


def test_bad_histograms_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("length,count\n100,-3\n")
    assert "count" in refused(["plan", *BASE, "--lengths", str(bad)], capsys)
    refused(["plan", *BASE, "--lengths", "no-such-preset"], capsys)
