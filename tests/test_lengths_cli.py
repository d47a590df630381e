"""``sp-plan lengths`` and the length-distribution loaders (issue 32 item 1): a local dataset (JSON lines,
parquet, a saved ``datasets`` folder) scanned with a local tokenizer into the same histogram, whose token
total is the tokenised lengths' sum; ``--max-docs``; CSV files; the shipped presets against their notes;
and every bad input as one line without a traceback."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from sp_plan.cli.main import main
from sp_plan.cost_models import data as shipped
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.lengths import (
    EXACT_MAX,
    FORMAT,
    LengthAccumulator,
    histogram_from_lengths,
    load_lengths,
    summarize,
)
from sp_plan.cost_models.units import MAX_SEQ_LEN

pytest.importorskip("datasets")
pytest.importorskip("transformers")

WORDS = ["sequence", "parallel", "ring", "ulysses", "token", "loss", "plan", "mesh", "shard", "gather", "attention", "zigzag"]


def console(args: list[str], capsys) -> tuple[int, str, str]:
    """The console script's exit code, stdout and stderr, in this process (imports paid once)."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer, the documents (long-tailed, a few above EXACT_MAX tokens) and the same data as JSON lines,
    parquet and a save_to_disk folder."""
    import datasets
    from sp_plan.runtime.text_data import build_bpe_tokenizer, load_tokenizer

    root = tmp_path_factory.mktemp("lengths")
    rng = random.Random(32)
    docs = [" ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(3.0, 1.2)) + 1)) for _ in range(400)]
    docs += [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (900, 1500, 1510, 1520, 4000)]
    rng.shuffle(docs)
    build_bpe_tokenizer(docs[:50], root / "tok", vocab_size=300)
    tokenizer = load_tokenizer(str(root / "tok"))
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs]
    with open(root / "docs.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs})
    ds.to_parquet(str(root / "docs.parquet"))
    ds.save_to_disk(str(root / "saved"))
    return {"root": root, "tok": str(root / "tok"), "docs": docs, "lengths": lengths}


def scan(corpus, capsys, source: str, *extra: str) -> tuple[dict, str]:
    out = corpus["root"] / f"{Path(source).name}{'-'.join(extra)}.json"
    code, stdout, err = console(["lengths", str(corpus["root"] / source), "--tokenizer", corpus["tok"], "--out",
                                 str(out), *extra], capsys)
    assert code == 0, err
    return json.loads(out.read_text()), stdout


def test_jsonl_parquet_and_saved_dataset_give_the_same_histogram(corpus, capsys):
    files = {source: scan(corpus, capsys, source)[0] for source in ("docs.jsonl", "docs.parquet", "saved")}
    bins = {source: document["bins"] for source, document in files.items()}
    assert bins["docs.jsonl"] == bins["docs.parquet"] == bins["saved"]
    document = files["docs.jsonl"]
    assert document["format"] == FORMAT and document["tokenizer"] == corpus["tok"] and document["eos_per_document"]
    assert any(length > EXACT_MAX for length, _ in document["bins"])  # the log bins are exercised
    histogram = load_lengths(str(corpus["root"] / "docs.jsonl.json"))
    # the token total is exact: every tokenised length plus the EOS the runtime appends
    assert histogram.tokens == sum(corpus["lengths"]) + len(corpus["docs"]) == document["summary"]["tokens"]
    assert histogram.documents == len(corpus["docs"])
    assert histogram.longest == max(corpus["lengths"]) + 1


def test_no_eos_and_the_printed_summary(corpus, capsys):
    document, stdout = scan(corpus, capsys, "docs.jsonl", "--no-eos")
    assert document["summary"]["tokens"] == sum(corpus["lengths"])
    for needle in ("documents: 405", "p50", "p99", "100-999", ">= 1,000,000", "% tokens", "wrote"):
        assert needle in stdout


def test_max_docs_reads_a_sample(corpus, capsys):
    document, _ = scan(corpus, capsys, "docs.parquet", "--max-docs", "50")
    assert document["summary"]["documents"] == 50 and document["sampled"] is True and document["max_docs"] == 50
    assert document["summary"]["tokens"] == sum(corpus["lengths"][:50]) + 50


def test_json_summary_is_strict_json(corpus, capsys):
    out = corpus["root"] / "j.json"
    code, stdout, err = console(["lengths", str(corpus["root"] / "saved"), "--tokenizer", corpus["tok"], "--out",
                                 str(out), "--json", "--quiet"], capsys)
    assert code == 0, err
    summary = json.loads(stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert summary["documents"] == len(corpus["docs"]) and summary["out"] == str(out)
    assert abs(sum(d["token_share"] for d in summary["decades"]) - 1) < 1e-9
    assert sum(d["documents"] for d in summary["decades"]) == summary["documents"]
    code, stdout, _ = console(["lengths", "--show", str(out), "--json"], capsys)
    assert code == 0 and json.loads(stdout)["tokens"] == summary["tokens"]


def test_csv_input(tmp_path, capsys):
    path = tmp_path / "lengths.csv"
    path.write_text("# measured by hand\nlength,count\n100,30\n2000,5\n\n100,10\n50000,1\n", encoding="utf-8")
    histogram = load_lengths(str(path))
    assert histogram.bins == ((100, 40), (2000, 5), (50000, 1))
    assert histogram.tokens == 100 * 40 + 2000 * 5 + 50000
    swapped = tmp_path / "swapped.csv"
    swapped.write_text("count,length,note\n40,100,x\n5,2000,y\n1,50000,z\n", encoding="utf-8")
    assert load_lengths(str(swapped)).bins == histogram.bins
    code, stdout, _ = console(["lengths", "--show", str(path)], capsys)
    assert code == 0 and "documents: 46" in stdout


def test_accumulator_bins_keep_totals_and_the_longest_exact():
    rng = random.Random(7)
    lengths = [max(1, int(rng.lognormvariate(7, 2))) for _ in range(20_000)]
    lengths = [min(n, 5_000_000) for n in lengths]
    accumulator = LengthAccumulator()
    accumulator.add(lengths)
    histogram = accumulator.histogram("random")
    exact = histogram_from_lengths(lengths)
    assert histogram.documents == len(lengths) and histogram.tokens == sum(lengths)
    assert histogram.longest == max(lengths)
    squares = sum(n * n for n in lengths)
    binned = sum(length * length * count for length, count in histogram.bins)
    assert abs(binned / squares - 1) < 0.02
    for q in (50, 90, 99):
        assert abs(histogram.percentile(q) / exact.percentile(q) - 1) <= 0.011
    assert len(histogram.bins) < 3_000 < len(exact.bins)


@pytest.mark.parametrize("name", shipped.names("lengths"))
def test_presets_match_what_their_notes_claim(name, capsys):
    spec = shipped.load("lengths", name)
    assert "arXiv" in spec["notes"] and "assum" in spec["notes"]  # cites its sources, says what is assumed
    summary = summarize(load_lengths(name))
    assert spec["claims"], "a preset states the ranges of its shape"
    for key, (low, high) in spec["claims"].items():
        assert low <= summary[key] <= high, (name, key, summary[key])
        assert f"{low:,}" in spec["notes"], (name, key)  # the notes state the same range
    code, stdout, _ = console(["lengths", "--show", name.upper()], capsys)
    assert code == 0 and f"p50 {summary['p50']:,}" in stdout


def test_preset_shapes_are_what_the_issue_asks_for():
    sft, long_mix = summarize(load_lengths("sft-short")), summarize(load_lengths("long-doc-mix"))
    assert 100 <= sft["p50"] < 1000 and 1000 <= sft["p99"] < 10_000  # median a few hundred, p99 a few thousand
    assert long_mix["max"] >= 100_000 and long_mix["token_p50"] >= 10_000  # a tail to 100K-1M tokens


def bad_lengths_files(tmp: Path) -> list[tuple[str, str, str]]:
    """(file name, content, what the one-line error must say)."""
    return [
        ("empty.json", "", "is empty"),
        ("blank.csv", "\n\n", "is empty"),
        ("zero.json", json.dumps({"format": FORMAT, "bins": [[10, 0]]}), "counts no documents"),
        ("none.json", json.dumps({"format": FORMAT, "bins": []}), "bins"),
        ("negative.csv", "length,count\n10,-3\n", "count -3"),
        ("fraction.csv", "length,count\n10.5,3\n", "'10.5' is not a whole number"),
        ("fraction.json", json.dumps({"format": FORMAT, "bins": [[10.5, 3]]}), "whole number"),
        ("huge.json", json.dumps({"format": FORMAT, "bins": [[MAX_SEQ_LEN + 1, 1]]}), f"outside 1..{MAX_SEQ_LEN}"),
        ("column.csv", "length,docs\n10,3\n", "no column count"),
        ("header.csv", "length,count\n", "no rows"),
        ("version.json", json.dumps({"format": "sp-plan-lengths/9", "bins": [[10, 1]]}), "sp-plan-lengths/1"),
        ("noformat.json", json.dumps({"bins": [[10, 1]]}), "no \"format\""),
        ("typo.json", json.dumps({"format": FORMAT, "bin": [[10, 1]]}), "unknown field"),
        ("broken.json", '{"format": ', "not valid JSON"),
        ("pair.json", json.dumps({"format": FORMAT, "bins": [[10, 1, 2]]}), "(length, count) pair"),
        ("digits.json", '{"format": "' + FORMAT + '", "bins": [[' + "9" * 5000 + ", 1]]}", "not valid JSON"),
    ]


def test_bad_lengths_files_are_one_line_each(tmp_path, capsys):
    for name, content, needle in bad_lengths_files(tmp_path):
        path = tmp_path / name
        path.write_text(content, encoding="utf-8")
        with pytest.raises(CostModelError, match=None) as caught:
            load_lengths(str(path))
        assert needle in str(caught.value) and "\n" not in str(caught.value), (name, str(caught.value))
        code, _, err = console(["lengths", "--show", str(path)], capsys)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and needle in err, (name, err)


def test_unknown_preset_names_the_closest(capsys):
    with pytest.raises(CostModelError, match="did you mean sft-short"):
        load_lengths("sft-shrt")
    code, _, err = console(["lengths", "--show", "no-such.csv"], capsys)
    assert code == 2 and "not found" in err and err.count("\n") == 1


def bad_datasets(root: Path, corpus) -> list[tuple[list[str], str]]:
    """(arguments after `lengths`, what the one-line error must say), each dataset written under ``root``."""
    import datasets

    (root / "empty.jsonl").write_text("", encoding="utf-8")
    (root / "blank.jsonl").write_text("\n\n", encoding="utf-8")
    (root / "broken.jsonl").write_text("not json\n", encoding="utf-8")
    (root / "content.jsonl").write_text('{"content": "a b", "id": 1}\n', encoding="utf-8")
    (root / "null.jsonl").write_text('{"text": "a b"}\n{"text": null}\n', encoding="utf-8")
    datasets.Dataset.from_dict({"text": [1, 2, 3]}).to_parquet(str(root / "numbers.parquet"))
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})) \
        .save_to_disk(str(root / "empty-saved"))
    datasets.Dataset.from_dict({"body": ["x"], "title": ["y"]}).save_to_disk(str(root / "body-saved"))
    (root / "notok").mkdir()
    (root / "mixed").mkdir()
    (root / "mixed" / "a.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    (root / "mixed" / "b.csv").write_text("text\nb\n", encoding="utf-8")
    tok = corpus["tok"]
    return [
        ([str(root / "empty.jsonl"), "--tokenizer", tok], "empty"),
        ([str(root / "blank.jsonl"), "--tokenizer", tok], "no documents"),
        ([str(root / "broken.jsonl"), "--tokenizer", tok], "cannot read dataset"),
        ([str(root / "empty-saved"), "--tokenizer", tok], "no documents"),
        ([str(root / "content.jsonl"), "--tokenizer", tok], "no field 'text' (fields: content, id)"),
        ([str(root / "body-saved"), "--tokenizer", tok], "(fields: body, title)"),
        ([str(root / "null.jsonl"), "--tokenizer", tok], "document 2"),
        ([str(root / "numbers.parquet"), "--tokenizer", tok], "not text"),
        ([str(root / "missing.jsonl"), "--tokenizer", tok], "does not exist"),
        ([str(root / "mixed"), "--tokenizer", tok], "mixes file types"),
        ([str(corpus["root"] / "docs.jsonl"), "--tokenizer", str(root / "no-such-tokenizer")], "does not exist"),
        ([str(corpus["root"] / "docs.jsonl"), "--tokenizer", str(root / "notok")], "save_pretrained"),
        ([str(corpus["root"] / "docs.jsonl"), "--tokenizer", tok, "--text-field", "id"], "not text"),
    ]


def test_bad_datasets_are_one_line_each(corpus, tmp_path, capsys):
    cases = bad_datasets(tmp_path, corpus)
    capsys.readouterr()  # datasets' own progress output while the fixtures are written
    for args, needle in cases:
        out = tmp_path / "out.json"
        code, _, err = console(["lengths", *args, "--out", str(out)], capsys)
        assert code == 2 and "Traceback" not in err and err.count("\n") == 1 and needle in err, (args, err)
        assert not out.exists()


def test_usage_errors(corpus, capsys):
    data = str(corpus["root"] / "docs.jsonl")
    for args, needle in ((["lengths"], "give DATA"), (["lengths", data, "--out", "x.json"], "--tokenizer is needed"),
                         (["lengths", data, "--tokenizer", corpus["tok"]], "--out is needed"),
                         (["lengths", data, "--show", "sft-short"], "--show prints"),
                         (["lengths", data, "--tokenizer", corpus["tok"], "--out", "/no/such/dir/x.json"],
                          "does not exist")):
        code, _, err = console(args, capsys)
        assert code == 2 and needle in err and "Traceback" not in err, (args, err)


def test_console_script_and_light_import():
    """The installed script answers a bad preset in one line; the command module imports no torch/datasets."""
    script = Path(sys.executable).with_name("sp-plan")
    result = subprocess.run([str(script), "lengths", "--show", "long-doc"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "did you mean long-doc-mix" in result.stderr
    probe = ("import sys, sp_plan.cli.commands.lengths; "
             "print(sorted(m for m in ('torch', 'datasets', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.strip() == "[]", result.stderr
