"""A dataset's document lengths, as the planner sees them: a histogram of (length, count) bins.

Real long-context sets are long-tailed (thousands of short documents, a few of 100K-1M tokens), so the
attention work of a packed sequence, the best SP degree and the balance across ranks depend on the whole
distribution, not on one typical length. The planner therefore takes the distribution itself.

A histogram is a tuple of bins ``(length, count)``: ``count`` documents of about ``length`` tokens.
Lengths are in tokens of the tokenizer that will train on them.

Binning (:class:`LengthAccumulator`, what ``sp-plan lengths`` writes): every length up to
:data:`EXACT_MAX` (1024) tokens is its own bin, exact. Above it, bin ``k`` holds the lengths in
``[EXACT_MAX * (1 + LOG_WIDTH)**k, EXACT_MAX * (1 + LOG_WIDTH)**(k+1))``, 1% wide (about 700 bins from 1K
to 1M tokens). A log bin is written as its documents' mean length, split between the two whole lengths
around it (``floor(mean)`` and ``floor(mean) + 1``, counts chosen so the lengths sum exactly): so the
token total is exact, each document's stored length is within 1% of its real one, and the sum of squared
lengths (the attention work) within about 2%. The longest document is always kept as its own exact bin,
so ``longest`` is exact. Memory is bounded: at most about 3,800 bins (1G tokens), whatever the number of
documents.

Inputs (:func:`load_lengths`): the JSON file ``sp-plan lengths`` writes (format :data:`FORMAT`), a CSV with
header ``length,count``, or a shipped preset (``cost_models/data/lengths/<name>.yaml``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sp_plan.cost_models.errors import CostModelError, explain_validation_error
from sp_plan.cost_models.units import MAX_SEQ_LEN

#: The most bins a histogram may hold (a log-spaced scan of 1..1G tokens at 1% width has ~2,100).
MAX_BINS = 100_000
#: The most documents one bin may count (a trillion-document set is far beyond any dataset).
MAX_COUNT = 10**15


class LengthHistogram(BaseModel):
    """Document-length distribution of a dataset (the planner's ``--lengths``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``(length, count)`` pairs, sorted by length, lengths distinct, counts positive.
    bins: tuple[tuple[int, int], ...] = Field(min_length=1, max_length=MAX_BINS)
    #: Where the distribution comes from (a dataset path, a preset's citation); shown in reports.
    source: str = ""

    @field_validator("bins", mode="before")
    @classmethod
    def _sorted_merged(cls, value: object) -> object:
        if not isinstance(value, (list, tuple)):
            return value
        merged: dict[int, int] = {}
        for item in value:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"each bin is a (length, count) pair, got {item!r}")
            length, count = item
            for name, number in (("length", length), ("count", count)):
                if isinstance(number, bool) or not isinstance(number, int):
                    raise ValueError(f"bin {name} must be a whole number, got {number!r}")
            if not 1 <= length <= MAX_SEQ_LEN:
                raise ValueError(f"document length {length} is outside 1..{MAX_SEQ_LEN} tokens")
            if count < 0 or count > MAX_COUNT:
                raise ValueError(f"document count {count} for length {length} is outside 0..{MAX_COUNT}")
            if count:
                merged[length] = merged.get(length, 0) + count
        if not merged:
            raise ValueError("the histogram counts no documents (every count is 0): nothing to plan from")
        return tuple(sorted(merged.items()))

    # ----- summaries -----

    @property
    def documents(self) -> int:
        return sum(count for _, count in self.bins)

    @property
    def tokens(self) -> int:
        return sum(length * count for length, count in self.bins)

    @property
    def longest(self) -> int:
        return self.bins[-1][0]

    @property
    def mean_length(self) -> float:
        return self.tokens / self.documents

    def percentile(self, q: float) -> int:
        """The length at or below which ``q`` percent of the documents lie (nearest rank)."""
        if not 0 <= q <= 100:
            raise CostModelError(f"percentile {q} is outside 0..100")
        rank = max(1, math.ceil(q / 100 * self.documents))
        seen = 0
        for length, count in self.bins:
            seen += count
            if seen >= rank:
                return length
        return self.longest

    def token_percentile(self, q: float) -> int:
        """The length at or below which the documents hold ``q`` percent of the tokens: what the compute
        sees (a set with 99% short documents may still hold most tokens in long ones)."""
        target = q / 100 * self.tokens
        seen = 0
        for length, count in self.bins:
            seen += length * count
            if seen >= target:
                return length
        return self.longest


def histogram_from_lengths(lengths: Iterable[int], source: str = "") -> LengthHistogram:
    """Exact histogram of the given document lengths (tests, small samples)."""
    counts: dict[int, int] = {}
    for length in lengths:
        counts[int(length)] = counts.get(int(length), 0) + 1
    return make_histogram(list(counts.items()), source, "document lengths")


def make_histogram(bins: object, source: str, what: str) -> LengthHistogram:
    """A :class:`LengthHistogram`, with pydantic's report turned into one actionable line."""
    try:
        return LengthHistogram(bins=bins, source=source)
    except ValidationError as error:
        raise explain_validation_error(error, what) from None


# ----- binning: what ``sp-plan lengths`` accumulates while it streams a dataset -----

#: Lengths up to this many tokens are kept exactly (one bin each).
EXACT_MAX = 1024
#: Relative width of a log-spaced bin above :data:`EXACT_MAX`.
LOG_WIDTH = 0.01
_LOG_STEP = math.log1p(LOG_WIDTH)


def log_bin(length: int) -> int:
    """The log-spaced bin of a length above :data:`EXACT_MAX` (bin 0 starts at EXACT_MAX + 1)."""
    return int(math.log(length / (EXACT_MAX + 1)) / _LOG_STEP)


class LengthAccumulator:
    """Streams document lengths into the module's bins in bounded memory (see the module docstring):
    ``add`` each batch of lengths, then :meth:`histogram`. Exact totals of documents and tokens."""

    def __init__(self) -> None:
        self._exact = [0] * (EXACT_MAX + 1)
        self._log: dict[int, list[int]] = {}  # bin -> [count, sum of lengths]
        self.documents = 0
        self.tokens = 0
        self.longest = 0

    def add(self, lengths: Iterable[int]) -> None:
        exact, log = self._exact, self._log
        for length in lengths:
            if length < 1 or length > MAX_SEQ_LEN:
                raise CostModelError(f"a document of {length} tokens is outside 1..{MAX_SEQ_LEN}: nothing trains on "
                                     "it; drop it from the dataset")
            self.documents += 1
            self.tokens += length
            self.longest = max(self.longest, length)
            if length <= EXACT_MAX:
                exact[length] += 1
            else:
                cell = log.setdefault(log_bin(length), [0, 0])
                cell[0] += 1
                cell[1] += length

    def bins(self) -> list[tuple[int, int]]:
        """``(length, count)`` pairs: exact ones, then each log bin as its mean split between two whole
        lengths so the tokens sum exactly, with the longest document on its own."""
        out = [(length, count) for length, count in enumerate(self._exact) if count]
        top = log_bin(self.longest) if self.longest > EXACT_MAX else None
        for key in sorted(self._log):
            count, total = self._log[key]
            if key == top:  # keep the longest document exact
                out.append((self.longest, 1))
                count, total = count - 1, total - self.longest
                if not count:
                    continue
            low, extra = divmod(total, count)  # `extra` documents of low + 1, the rest of low
            if count - extra:
                out.append((low, count - extra))
            if extra:
                out.append((low + 1, extra))
        return out

    def histogram(self, source: str = "") -> LengthHistogram:
        if not self.documents:
            raise CostModelError("no documents were read: the dataset is empty (or --max-docs is 0)")
        return make_histogram(self.bins(), source, "document lengths")


def histogram_from_distribution(counts: Iterable[tuple[float, float]], source: str = "") -> LengthHistogram:
    """A histogram in the module's bins from *expected* counts: ``(length, expected documents)`` pairs over
    whole lengths (a parametric shape evaluated per length, as ``benchmarks/make_length_presets.py`` does).
    Each bin's count is the rounded cumulative expectation (so the rare long tail keeps its documents where
    their expected number adds up, not dropped bin by bin) and its length the expectation-weighted mean."""
    cells: dict[int, list[float]] = {}
    for length, expected in counts:
        if expected <= 0:
            continue
        key = int(length) if length <= EXACT_MAX else EXACT_MAX + 1 + log_bin(int(length))
        cell = cells.setdefault(key, [0.0, 0.0])
        cell[0] += expected
        cell[1] += expected * length
    bins = []
    cumulative, written = 0.0, 0
    for key in sorted(cells):
        expected, weighted = cells[key]
        cumulative += expected
        count = round(cumulative) - written
        if count > 0:
            bins.append((max(1, round(weighted / expected)), count))
            written += count
    return make_histogram(bins, source, "length distribution")


# ----- summaries a person reads -----

#: Decades of length in the summary table: [low, high) tokens (None: no upper end).
DECADES: tuple[tuple[int, int | None], ...] = (
    (1, 10), (10, 100), (100, 1_000), (1_000, 10_000), (10_000, 100_000), (100_000, 1_000_000), (1_000_000, None))


def decade_label(low: int, high: int | None) -> str:
    return f">= {low:,}" if high is None else f"{low:,}-{high - 1:,}"


def summarize(histogram: LengthHistogram) -> dict:
    """What a person wants to see of a distribution (strict-JSON-safe: finite numbers only): documents,
    tokens, mean, p50/p90/p99/max length, the length at which half the tokens are reached, and per decade of
    length its documents and tokens with their shares."""
    documents, tokens = histogram.documents, histogram.tokens
    decades = []
    for low, high in DECADES:
        docs = sum(c for length, c in histogram.bins if length >= low and (high is None or length < high))
        toks = sum(length * c for length, c in histogram.bins if length >= low and (high is None or length < high))
        decades.append({"range": decade_label(low, high), "from": low, "to": None if high is None else high - 1,
                        "documents": docs, "tokens": toks,
                        "document_share": docs / documents, "token_share": toks / tokens})
    return {
        "source": histogram.source,
        "documents": documents,
        "tokens": tokens,
        "mean": tokens / documents,
        "p50": histogram.percentile(50),
        "p90": histogram.percentile(90),
        "p99": histogram.percentile(99),
        "max": histogram.longest,
        "token_p50": histogram.token_percentile(50),
        "bins": len(histogram.bins),
        "decades": decades,
    }


# ----- the file format and the loaders -----

#: The format tag of the JSON file ``sp-plan lengths`` writes; bumped when its meaning changes.
FORMAT = "sp-plan-lengths/1"
#: Fields that file may hold (``summary`` is derived and recomputed on load; the rest are provenance).
JSON_FIELDS = frozenset({"format", "bins", "source", "tokenizer", "text_field", "eos_per_document", "max_docs",
                         "sampled", "binning", "summary", "notes"})
#: Text of the ``binning`` field written with each file.
BINNING = (f"exact lengths up to {EXACT_MAX} tokens; above, log-spaced bins {LOG_WIDTH:.0%} wide, each written as "
           "its documents' mean length split between two adjacent whole lengths (the token total is exact); the "
           "longest document exact")
KIND = "lengths"


def lengths_document(histogram: LengthHistogram, **provenance: object) -> dict:
    """The JSON object of format :data:`FORMAT`: provenance fields, the bins and the summary."""
    unknown = set(provenance) - JSON_FIELDS
    if unknown:
        raise ValueError(f"not fields of {FORMAT}: {sorted(unknown)}")
    return {"format": FORMAT, "source": histogram.source, **provenance, "binning": BINNING,
            "bins": [list(b) for b in histogram.bins], "summary": summarize(histogram)}


def parse_lengths_json(text: str, where: str) -> LengthHistogram:
    """A histogram from the text of a :data:`FORMAT` file; every problem is one line naming ``where``."""
    import json

    from .json_io import json_loads

    try:
        data = json_loads(text)
    except json.JSONDecodeError as exc:
        raise CostModelError(f"lengths file {where} is not valid JSON ({exc.msg}, line {exc.lineno}): give the "
                             "file `sp-plan lengths --out` wrote, or a CSV with header length,count") from None
    if not isinstance(data, dict):
        raise CostModelError(f"lengths file {where} holds a JSON {type(data).__name__}, not an object with "
                             f'"format": "{FORMAT}" and "bins"')
    found = data.get("format")
    if found != FORMAT:
        what = "has no \"format\" field" if found is None else f"has format {found!r}"
        raise CostModelError(f"lengths file {where} {what}; this sp-plan reads {FORMAT!r}: write it again with "
                             "`sp-plan lengths`, or give a CSV with header length,count")
    unknown = sorted(set(data) - JSON_FIELDS)
    if unknown:
        raise CostModelError(f"lengths file {where} has unknown field(s) {', '.join(map(repr, unknown))}: the "
                             f"fields of {FORMAT} are {', '.join(sorted(JSON_FIELDS))}")
    if "bins" not in data:
        raise CostModelError(f'lengths file {where} has no "bins": a list of [length, count] pairs')
    source = data.get("source")
    return make_histogram(data["bins"], source if isinstance(source, str) else where, f"lengths file {where}")


def parse_lengths_csv(text: str, where: str) -> LengthHistogram:
    """A histogram from CSV text with a header holding ``length`` and ``count`` (other columns ignored;
    blank lines and lines starting with ``#`` skipped)."""
    import csv

    try:
        return _parse_lengths_csv(text, where)
    except csv.Error as exc:  # a field over the csv module's limit, a NUL byte: not a length table
        raise CostModelError(f"lengths file {where} is not a readable CSV ({exc}): give a header length,count and "
                             "one short row per length, or the JSON `sp-plan lengths` writes") from None


def _parse_lengths_csv(text: str, where: str) -> LengthHistogram:
    import csv

    rows = ((number, row) for number, row in enumerate(csv.reader(text.splitlines()), start=1)
            if row and any(cell.strip() for cell in row) and not row[0].lstrip().startswith("#"))
    header = next(rows, None)
    if header is None:
        raise CostModelError(f"lengths file {where} holds no rows: give a header length,count and one row per "
                             "length")
    names = [cell.strip().lower() for cell in header[1]]
    missing = [name for name in ("length", "count") if name not in names]
    if missing:
        raise CostModelError(f"lengths file {where} has no column {' or '.join(missing)} in its header (line "
                             f"{header[0]}: {','.join(header[1])}): the first row must name the columns, e.g. "
                             "length,count")
    at_length, at_count = names.index("length"), names.index("count")
    bins = []
    for number, row in rows:
        if len(bins) >= MAX_BINS:
            raise CostModelError(f"lengths file {where} has more than {MAX_BINS:,} rows: merge lengths into wider "
                                 "bins (sp-plan lengths writes at most about 3,800)")
        values = []
        for column, index in (("length", at_length), ("count", at_count)):
            cell = row[index].strip() if index < len(row) else ""
            try:
                values.append(int(cell))
            except ValueError:
                raise CostModelError(f"lengths file {where} line {number}: {column} {cell!r} is not a whole number "
                                     "of tokens/documents") from None
        bins.append(tuple(values))
    if not bins:
        raise CostModelError(f"lengths file {where} has a header but no rows: add one length,count row per length")
    return make_histogram(bins, where, f"lengths file {where}")


def load_lengths(ref: str) -> LengthHistogram:
    """A document-length distribution from a shipped preset name, the JSON file ``sp-plan lengths`` writes
    (``.json``), or a CSV with header ``length,count`` (``.csv``, or any other file starting with that
    header). Unknown names are refused with the closest presets; every bad file is one line."""
    from . import data

    found = data.resolve(KIND, ref)
    if found.shipped:
        spec = data.load(KIND, found.name)
        return make_histogram(spec.get("bins"), str(spec.get("source") or f"preset {found.name}"),
                              f"shipped lengths preset {found.name}")
    path = found.path
    text = data.read_user_text(KIND, path)
    if not text.strip():
        raise CostModelError(f"lengths file {path} is empty: give the file `sp-plan lengths --out` wrote, or a CSV "
                             "with header length,count")
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        return parse_lengths_json(text, str(path))
    return parse_lengths_csv(text, str(path))


def preset_names() -> tuple[str, ...]:
    """The shipped length distributions."""
    from . import data

    return data.names(KIND)
