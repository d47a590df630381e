"""``sp-plan lengths``: scan a local dataset's document lengths into a histogram file (or show one).

    sp-plan lengths DATA --tokenizer NAME_OR_PATH [--text-field text] [--max-docs N] --out lengths.json
    sp-plan lengths --show FILE_OR_PRESET [--json]

DATA is a local JSON-lines/JSON/parquet/CSV/text file, a directory of such files, or a
``datasets.save_to_disk`` directory. The scan streams (``datasets`` in streaming mode, or the memory-mapped
Arrow of a saved dataset), tokenises in batches bounded by characters with the tokenizer's fast backend, and
accumulates the bins of :class:`sp_plan.cost_models.lengths.LengthAccumulator`: memory does not grow with
the dataset. A document's length is its token count without special tokens, plus one for the EOS that
separates packed documents (``--no-eos`` leaves it out), as the runtime packs them.

``datasets``/``transformers`` (and the runtime's tokenizer loader) are imported inside the command, so
``sp-plan --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from sp_plan.cost_models.atomic_io import atomic_write_text
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.lengths import (
    LengthAccumulator,
    LengthHistogram,
    lengths_document,
    load_lengths,
    summarize,
)
from sp_plan.cost_models.text_table import Column, format_table

from .common import check_output_path

#: Rows read from the dataset at a time.
ROWS_PER_BATCH = 1000
#: Characters tokenised in one call (a batch of long documents is split so memory stays bounded).
CHARS_PER_CALL = 8 << 20
#: Files ``datasets.save_to_disk`` writes (a directory holding one is loaded from disk, not scanned for files).
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@click.command(name="lengths", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("data", required=False, metavar="[DATA]")
@click.option("--tokenizer", default=None, metavar="NAME_OR_PATH",
              help="Tokenizer that will train on the data: a directory saved with save_pretrained, or a hub name "
                   "(cached, or with network).")
@click.option("--text-field", default="text", show_default=True, help="The field (column) holding each document.")
@click.option("--split", default="train", show_default=True, help="Split of a saved DatasetDict.")
@click.option("--max-docs", type=click.IntRange(1, None), default=None,
              help="Read only the first N documents (a quick sample).")
@click.option("--eos/--no-eos", default=True, show_default=True,
              help="Count the EOS token the runtime appends to every packed document.")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write the histogram here (JSON, format sp-plan-lengths/1; - for standard output).")
@click.option("--show", "show", default=None, metavar="FILE_OR_PRESET",
              help="Print the summary of an existing lengths file (JSON or CSV) or a shipped preset instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def command(data: str | None, tokenizer: str | None, text_field: str, split: str, max_docs: int | None, eos: bool,
            out: str | None, show: str | None, as_json: bool, quiet: bool) -> None:
    """Document-length histogram of a local dataset, for the planner's --lengths.

    Scans DATA (a .jsonl/.json/.parquet/.csv/.txt file, a folder of them, or a datasets.save_to_disk
    folder) with --tokenizer and writes --out lengths.json; prints documents, tokens, mean, p50/p90/p99/max
    and the tokens in each decade of length. `--show FILE_OR_PRESET` prints the same for an existing file or
    a shipped preset (sft-short, long-doc-mix).
    """
    if show is not None:
        if data is not None or tokenizer is not None or out is not None or max_docs is not None:
            raise click.UsageError("--show prints an existing file or preset: give it without DATA, --tokenizer, "
                                   "--out or --max-docs")
        _report(load_lengths(show), as_json)
        return
    if data is None:
        raise click.UsageError("give DATA to scan (with --tokenizer and --out), or --show FILE_OR_PRESET")
    if tokenizer is None:
        raise click.UsageError("--tokenizer is needed: the tokenizer that will train on the data (a local directory "
                               "or a hub name)")
    if out is None:
        raise click.UsageError("--out is needed: the file to write the histogram to (e.g. --out lengths.json)")
    if as_json and out == "-":
        raise click.UsageError("--json and --out - would both write standard output: give --out a file name")
    check_output_path(out, "--out")
    _check_data_path(data)
    tok = _load_tokenizer(tokenizer)
    dataset, total = _open_dataset(data, split, text_field)
    histogram = scan(dataset, tok, text_field, source=data, max_docs=max_docs, eos=eos, total=total,
                     progress=not quiet)
    document = lengths_document(histogram, tokenizer=str(tokenizer), text_field=text_field, eos_per_document=eos,
                                max_docs=max_docs, sampled=max_docs is not None and histogram.documents >= max_docs)
    text = strict_dumps(document, "lengths file", indent=None, separators=(",", ":")) + "\n"
    if out == "-":
        sys.stdout.write(text)
    else:
        atomic_write_text(out, text)
    _report(histogram, as_json, written=None if out == "-" else out, to_stderr=out == "-")


# ----- reading ----------------------------------------------------------------------------------------------


def _check_data_path(data: str) -> None:
    path = Path(data).expanduser()
    if not path.exists():
        raise CostModelError(f"dataset path {data} does not exist: give a local .jsonl/.parquet file, a folder of "
                             "them, or a datasets.save_to_disk folder")


def _load_tokenizer(name_or_path: str):
    try:
        from sp_plan.runtime.text_data import load_tokenizer
    except ImportError as exc:  # torch or transformers missing
        raise CostModelError(f"sp-plan lengths needs the runtime and Hugging Face extras ({exc.name} is missing): "
                             "pip install 'sp-plan[runtime,hf]'") from None
    from sp_plan.runtime.text_data import TOKENIZER_FILES

    path = Path(name_or_path).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CostModelError(f"tokenizer directory {name_or_path} holds none of {', '.join(TOKENIZER_FILES)}: pass a "
                             "directory saved with save_pretrained (or a hub name)")
    tokenizer = load_tokenizer(name_or_path)
    if not getattr(tokenizer, "is_fast", False):
        click.echo(f"warning: tokenizer {name_or_path!r} has no fast (Rust) backend; the scan will be slow",
                   err=True)
    return tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _cannot_read(data: str, exc: BaseException) -> CostModelError:
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    reason = "" if root is exc else f" ({type(root).__name__}: {_first_line(root)})"
    return CostModelError(f"cannot read dataset {data}: {_first_line(exc)}{reason}")


def _open_dataset(data: str, split: str, text_field: str) -> tuple[Any, int | None]:
    """A dataset to iterate (a memory-mapped ``Dataset`` or a streaming ``IterableDataset``) and its number of
    rows when known."""
    try:
        import datasets
    except ImportError:
        raise CostModelError("sp-plan lengths needs `datasets`: pip install 'sp-plan[hf]'") from None
    from sp_plan.runtime.json_nesting import check_json_nesting
    from sp_plan.runtime.text_data import BUILDERS

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its readers log an error before raising it
    path = Path(data).expanduser()
    try:
        if path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS):
            if _saved_without_data(path):
                raise CostModelError(f"dataset {data} has no documents (a save_to_disk folder with no data files): "
                                     "there is nothing to measure")
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise CostModelError(f"dataset {data} has splits {', '.join(sorted(ds))}, not {split!r}: pick one "
                                         "with --split")
                ds = ds[split]
            _check_field(data, text_field, ds.column_names, ds.features)
            if not len(ds):
                raise CostModelError(f"dataset {data} holds no documents: there is nothing to measure")
            return ds.select_columns([text_field]), len(ds)
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*")
                                                      if f.is_file() and f.suffix.lower() in BUILDERS)
        builders = {BUILDERS.get(f.suffix.lower()) for f in files}
        if not files or None in builders:
            raise CostModelError(f"dataset {data} is not a file this reads ({', '.join(sorted(BUILDERS))}), a folder "
                                 "of them, or a datasets.save_to_disk folder")
        if len(builders) > 1:
            raise CostModelError(f"dataset folder {data} mixes file types ({', '.join(sorted(builders))}): keep one "
                                 "kind, or point at one file")
        if all(f.stat().st_size == 0 for f in files):
            raise CostModelError(f"dataset {data} is empty: there are no documents to measure")
        builder = builders.pop()
        if builder == "json":
            check_json_nesting(files)  # pyarrow's JSON reader segfaults on deep nesting
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True)
    except CostModelError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types
        raise _cannot_read(data, exc) from None
    if ds.features:  # known and not empty (a file of blank lines has no columns: found empty when read)
        _check_field(data, text_field, list(ds.features), ds.features)
    return ds, None


def _saved_without_data(path: Path) -> bool:
    """A ``save_to_disk`` of an empty dataset lists no data files, and ``load_from_disk`` then fails inside
    datasets with an IndexError; say what it is instead."""
    state = path / "state.json"
    try:
        return state.is_file() and json.loads(state.read_text(encoding="utf-8")).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def _check_field(data: str, field: str, columns: list[str], features: Any) -> None:
    if field not in columns:
        raise CostModelError(f"dataset {data} has no field {field!r} (fields: {', '.join(columns) or 'none'}): name "
                             "the one holding the documents with --text-field")
    feature = features[field] if features is not None else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise CostModelError(f"field {field!r} of dataset {data} holds {_describe(feature)}, not text: name the "
                             "field holding the documents with --text-field")


def _describe(feature: Any) -> str:
    dtype = getattr(feature, "dtype", None)
    return f"{dtype} values" if dtype else type(feature).__name__


def _batches(dataset, data: str, field: str) -> Iterator[list[str]]:
    """The text field in batches of rows, each value checked to be text; read errors are one line."""
    rows = iter(dataset.iter(batch_size=ROWS_PER_BATCH))
    seen = 0
    while True:
        try:
            batch = next(rows)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise CostModelError(f"dataset {data} holds text that is not UTF-8 ({exc.reason} at byte {exc.start}): "
                                 "re-encode the files as UTF-8") from None
        except CostModelError:
            raise
        except Exception as exc:
            raise _cannot_read(data, exc) from None
        if not batch or not any(len(column) for column in batch.values()):  # blank lines: no rows
            continue
        if field not in batch:
            raise CostModelError(f"dataset {data} has no field {field!r} (fields: {', '.join(batch) or 'none'}): "
                                 "name the one holding the documents with --text-field")
        texts = batch[field]
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                what = "null (missing)" if text is None else f"a {type(text).__name__}"
                raise CostModelError(f"document {seen + index + 1} of dataset {data} has {what} in field {field!r}, "
                                     "not text: clean the dataset or name the text field with --text-field")
        seen += len(texts)
        yield texts


def _token_counts(tokenizer, texts: list[str]) -> list[int]:
    counts: list[int] = []
    start = 0
    while start < len(texts):  # calls bounded by characters: a batch of books does not hold all their ids at once
        end, chars = start, 0
        while end < len(texts) and (end == start or chars + len(texts[end]) <= CHARS_PER_CALL):
            chars += len(texts[end])
            end += 1
        encoded = tokenizer(texts[start:end], add_special_tokens=False, return_attention_mask=False,
                            return_token_type_ids=False, verbose=False)["input_ids"]
        counts.extend(len(ids) for ids in encoded)
        start = end
    return counts


def scan(dataset, tokenizer, text_field: str, *, source: str, max_docs: int | None = None, eos: bool = True,
         total: int | None = None, progress: bool = True) -> LengthHistogram:
    """Stream ``dataset``'s ``text_field`` through ``tokenizer`` into a :class:`LengthHistogram`."""
    accumulator = LengthAccumulator()
    extra = 1 if eos else 0
    limit = max_docs if max_docs is not None else None
    bar_total = min(x for x in (total, limit) if x is not None) if (total or limit) else None
    bar = _progress(bar_total, enabled=progress)
    try:
        for texts in _batches(dataset, source, text_field):
            if limit is not None:
                texts = texts[:limit - accumulator.documents]
            lengths = [n + extra for n in _token_counts(tokenizer, texts)]
            if not eos and 0 in lengths:
                raise CostModelError(f"dataset {source} has a document with no tokens (an empty {text_field!r}) and "
                                     "--no-eos leaves it 0 tokens long: drop empty documents, or count the EOS")
            accumulator.add(lengths)
            if bar is not None:
                bar.update(len(texts))
                bar.set_postfix_str(f"{accumulator.tokens:,} tokens", refresh=False)
            if limit is not None and accumulator.documents >= limit:
                break
    finally:
        if bar is not None:
            bar.close()
    if not accumulator.documents:
        raise CostModelError(f"dataset {source} holds no documents: there is nothing to measure")
    return accumulator.histogram(source)


def _progress(total: int | None, *, enabled: bool):
    """A tqdm bar on standard error, only when it is a terminal (and not --quiet)."""
    if not enabled or not sys.stderr.isatty() or os.environ.get("TERM") == "dumb":
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=" docs", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


# ----- reporting --------------------------------------------------------------------------------------------


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def summary_lines(summary: dict) -> list[str]:
    """The human summary of :func:`sp_plan.cost_models.lengths.summarize`."""
    lines = [
        f"source:    {summary['source']}" if summary["source"] else "source:    (not given)",
        f"documents: {summary['documents']:,}",
        f"tokens:    {summary['tokens']:,}",
        (f"length:    mean {summary['mean']:,.1f}, p50 {summary['p50']:,}, p90 {summary['p90']:,}, "
         f"p99 {summary['p99']:,}, max {summary['max']:,} tokens"),
        f"half the tokens are in documents of {summary['token_p50']:,}+ tokens",
        "",
    ]
    columns = [Column("length (tokens)"), Column("documents", ">"), Column("% docs", ">"), Column("tokens", ">"),
               Column("% tokens", ">")]
    rows = [(d["range"], f"{d['documents']:,}", _share(d["document_share"]), f"{d['tokens']:,}",
             _share(d["token_share"])) for d in summary["decades"]]
    return lines + format_table(columns, rows)


def _report(histogram: LengthHistogram, as_json: bool, *, written: str | None = None, to_stderr: bool = False) -> None:
    summary = summarize(histogram)
    if as_json:
        payload = {**summary, "out": written} if written is not None else summary
        click.echo(strict_dumps(payload, "lengths summary", indent=2))
        return
    lines = summary_lines(summary)
    if written is not None:
        lines.append(f"\nwrote {written} ({len(histogram.bins):,} bins)")
    click.echo("\n".join(lines), err=to_stderr)
