"""Real training data: a Hugging Face text dataset and tokenizer, packed to the planned sequence length,
served as a deterministic, resumable, data-parallel stream of global batches.

Three pieces (``datasets`` and ``transformers`` come with the ``[hf]`` extra and are imported lazily):

1. :func:`load_text_dataset`: a ``datasets.Dataset`` from a local path (``datasets.save_to_disk``
   output, a ``.jsonl``/``.json``/``.txt``/``.parquet``/``.csv``/``.arrow`` file or a directory of
   them) or a hub name (cached, or with network); :func:`load_tokenizer`:
   ``transformers.AutoTokenizer.from_pretrained`` (a local directory or a hub name), which must have an
   EOS token (it separates packed documents).
2. :class:`PackedTextDataset`: every document tokenised (no special tokens) and followed by EOS, the
   stream cut into rows of ``seq_len`` tokens by :func:`sp_plan.runtime.data.pack_documents` (a document
   may continue in the next row; the final partial row is dropped). Built once, in one streaming pass,
   into a cache directory keyed by the dataset's fingerprint, the tokenizer, the text column,
   ``seq_len`` and the position mode; memory-mapped afterwards (rank 0 builds, the others wait and map
   it; build errors reach every rank). ``packing="first_fit"|"sorted"`` places whole documents in rows with the
   planner's :func:`sp_plan.cost_models.packing.pack` instead (documents longer than a row split into pieces that
   continue in order, each row's tail padded, padding labelled ignored; format 2); the cache's metadata records
   the document-length histogram either way (what ``sp-plan train`` plans on). ``positions``:

   - ``"continuous"`` (GPT-style, the default): samples are ``(seq_len,)`` token tensors, positions
     run 0..seq_len-1 and attention crosses document boundaries inside a row (the GPT objective;
     what the runtime's attention computes exactly);
   - ``"per_document"`` (HF packed format): samples are dicts with ``position_ids`` restarting at 0 at
     every document start (and at the row start for a document continued from the previous row). The
     sharder (:class:`sp_plan.runtime.data.BatchSharder`) turns them into document boundaries: no label
     crosses a document start and attention is document-masked (or crosses documents with its
     ``cross_document_attention=True`` opt-in).
3. :class:`GlobalBatches`: the order of sequences is one global stream, independent of the layout:
   epoch ``e`` is a permutation of all rows seeded by ``seed + e`` (or the identity without shuffling),
   epochs follow each other, and optimizer step ``k`` consumes stream positions
   ``[k G, (k + 1) G)`` with ``G = micro_batch x grad_accum x dp_size`` sequences; data-parallel rank
   ``r`` takes its ``micro_batch x grad_accum`` consecutive positions of that window. The position is
   one integer, *sequences consumed*: saved with a checkpoint, it resumes at the same place with any
   data-parallel size (and the same global batch gives every step the same sequences).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.json_io import json_loads
from sp_plan.cost_models.lengths import LengthAccumulator, LengthHistogram, make_histogram
from sp_plan.cost_models.packing import PACKINGS, pack
from sp_plan.runtime.data import IGNORE_INDEX, pack_documents
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.json_nesting import check_json_nesting

#: Bumped when the packed cache's layout changes (old caches are then rebuilt, not misread). Format 1: stream
#: packing, every row full; format 2: whole-document packings (``first_fit``, ``sorted``), rows padded at the
#: end (and each document to ``multiple``), with a per-token mask of the real tokens (:data:`VALID_FILE`).
PACK_FORMAT = 1
PADDED_PACK_FORMAT = 2
PACK_FORMATS = (PACK_FORMAT, PADDED_PACK_FORMAT)
POSITION_MODES = ("continuous", "per_document")
#: File suffix -> the ``datasets`` builder that reads it.
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
            ".csv": "csv", ".arrow": "arrow"}
META_FILE = "meta.json"
TOKENS_FILE = "tokens.u32"
STARTS_FILE = "starts.i64"
OFFSETS_FILE = "row_starts.i64"
#: Padded packings: 1 where a row's token is a document's, 0 where it is padding (uint8, rows x seq_len).
VALID_FILE = "valid.u8"
#: Padded packings, while building: every document's tokens (EOS included) back to back, and their lengths.
DOCUMENTS_FILE = "documents.u32"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ----- loading ----------------------------------------------------------------------------------------------


def _looks_like_path(source: str) -> bool:
    """A local path rather than a hub name (``org/name``)."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or Path(source).suffix.lower() in BUILDERS


def check_dataset_source(source: Any) -> None:
    """Raise at once for a dataset given as a local path that does not exist (before any slow loading)."""
    if isinstance(source, (str, os.PathLike)) and _looks_like_path(str(source)) \
            and not Path(source).expanduser().exists():
        raise RuntimeConfigError(f"dataset path {source} does not exist: pass a local file or directory "
                                 "(or a Hugging Face hub dataset name)")


def load_text_dataset(source: Any, *, split: str = "train", text_column: str = "text",
                      cache_dir: str | os.PathLike | None = None):
    """A ``datasets.Dataset`` with a string column ``text_column`` from ``source``: a ``Dataset``
    (or ``DatasetDict``), a local path (``save_to_disk`` output, a data file or a directory of data
    files) or a hub dataset name. Raises :class:`RuntimeConfigError` with what to do on any problem."""
    try:
        import datasets
    except ImportError:
        raise RuntimeConfigError("reading a Hugging Face dataset needs `datasets`: pip install 'sp-plan[hf]'") from None
    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
        ds = source
    else:
        ds = _load_source(datasets, str(source), split, cache_dir)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise RuntimeConfigError(f"dataset {source} has splits {sorted(ds)}, not {split!r}: pick one (--split)")
        ds = ds[split]
    if not isinstance(ds, datasets.Dataset):
        raise RuntimeConfigError(f"dataset {source} is a {type(ds).__name__}; a map-style datasets.Dataset is needed")
    if text_column not in ds.column_names:
        raise RuntimeConfigError(
            f"dataset {source} has no column {text_column!r} (columns: {', '.join(ds.column_names)}): "
            "pass the text column's name (--text-column)"
        )
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise RuntimeConfigError(f"column {text_column!r} of dataset {source} holds {feature}, not text")
    return ds


def _load_source(datasets, source: str, split: str, cache_dir) -> Any:
    path = Path(source).expanduser()
    kwargs = {"cache_dir": str(cache_dir)} if cache_dir is not None else {}
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "state.json",
                                                                  "dataset_dict.json")):
            return datasets.load_from_disk(str(path))
        if path.exists():
            files = [path] if path.is_file() else sorted(f for f in path.rglob("*")
                                                          if f.is_file() and f.suffix.lower() in BUILDERS)
            builders = {BUILDERS.get(f.suffix.lower()) for f in files}
            if not files or None in builders:
                raise RuntimeConfigError(
                    f"dataset path {path} has no data files this loader reads ({', '.join(sorted(BUILDERS))}), "
                    "nor is it a datasets.save_to_disk directory"
                )
            if len(builders) > 1:
                raise RuntimeConfigError(f"dataset directory {path} mixes file types {sorted(builders)}: keep one kind")
            builder = builders.pop()
            if builder == "json":
                check_json_nesting(files)  # pyarrow's reader segfaults on deep nesting
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split, **kwargs)
        check_dataset_source(source)
        return datasets.load_dataset(source, split=split, **kwargs)
    except RuntimeConfigError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError ...)
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (offline mode: only local paths and cached datasets load)" if offline else ""
        root = exc
        while root.__cause__ is not None and root.__cause__ is not root:  # datasets wraps the reader's reason
            root = root.__cause__
        reason = "" if root is exc else f" ({type(root).__name__}: {_first_line(root)})"
        raise RuntimeConfigError(f"cannot load dataset {source!r}{hint}: {_first_line(exc)}{reason}") from None


#: Seconds the one hub query of :func:`tokenizer_source_problem` may take (no retries: a name that is not
#: there must fail in seconds, not after transformers' minute of offline back-off on every rank).
HUB_QUERY_TIMEOUT_S = 5.0
#: Files whose presence in the local hub cache means a tokenizer was downloaded before.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def hub_offline() -> bool:
    """Whether the Hugging Face hub must not be contacted (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in ("1", "ON", "YES",
                                                                                                    "TRUE")


def cached_on_hub(repo_id: str) -> bool:
    """Whether the local hub cache holds a tokenizer file of ``repo_id`` (no network)."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in TOKENIZER_FILES)


def tokenizer_source_problem(name_or_path: str, *, hub_timeout_s: float = HUB_QUERY_TIMEOUT_S) -> str | None:
    """Why ``name_or_path`` cannot be a tokenizer, in one actionable sentence, or None when it can be loaded.

    Local first: an existing path, else (for a hub name) the local hub cache; only then, unless offline,
    one hub query bounded by ``hub_timeout_s`` and without retries. ``sp-plan train`` runs this before any
    rank starts work, so a misspelt name costs seconds (transformers' own loader retries for about a minute
    offline, on every rank). Needs ``huggingface_hub`` (a transformers dependency), imported lazily."""
    text = str(name_or_path)
    if Path(text).expanduser().exists():
        return None
    if _looks_like_path(text):
        return (f"tokenizer path {text} does not exist: pass a directory saved with save_pretrained (or a hub "
                "name)")
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        return "--tokenizer needs transformers: pip install 'sp-plan[hf]'"
    try:
        validate_repo_id(text)
    except HFValidationError:
        return (f"tokenizer {text!r} is neither an existing local path nor a valid Hugging Face hub name "
                "(org/name): check the spelling, or pass a directory saved with save_pretrained")
    if cached_on_hub(text):
        return None
    where = f"not a local directory and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if hub_offline():
        return (f"tokenizer {text!r} is {where}, and the hub is offline (HF_HUB_OFFLINE): check the spelling, "
                "pass a directory saved with save_pretrained, or download it once with the hub reachable")
    try:
        HfApi().model_info(text, timeout=hub_timeout_s)
    except GatedRepoError:
        return (f"tokenizer {text!r} is a gated hub repository: accept its terms on huggingface.co and log in "
                "(hf auth login), or pass a local directory")
    except RepositoryNotFoundError:
        return (f"tokenizer {text!r} is {where}, and the Hugging Face hub has no such repository (or it is "
                "private): check the spelling, log in for a private one, or pass a local directory")
    except Exception as exc:  # connection refused, DNS failure, timeout, proxy error: one line, no retries
        return (f"tokenizer {text!r} is {where}, and the Hugging Face hub ({constants.ENDPOINT}) cannot be "
                f"reached ({type(exc).__name__}: {_first_line(exc)}): pass a local directory, or set "
                "HF_HUB_OFFLINE=1 when working offline")
    return None


def check_tokenizer_source(name_or_path: str) -> None:
    """Raise :class:`RuntimeConfigError` with :func:`tokenizer_source_problem`'s reason, if any."""
    problem = tokenizer_source_problem(name_or_path)
    if problem:
        raise RuntimeConfigError(problem)


def load_tokenizer(name_or_path: Any):
    """``AutoTokenizer.from_pretrained(name_or_path)`` (a tokenizer object is passed through), checked to
    have an EOS token (packed documents are separated by it). A name or path is checked first
    (:func:`tokenizer_source_problem`: local path, local hub cache, one bounded hub query), and a hub name
    found in the cache is loaded from it without contacting the hub."""
    if isinstance(name_or_path, (str, os.PathLike)):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise RuntimeConfigError("--tokenizer needs transformers: pip install 'sp-plan[hf]'") from None
        check_tokenizer_source(str(name_or_path))
        path = Path(name_or_path).expanduser()
        local_only = not path.exists() and cached_on_hub(str(name_or_path))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else str(name_or_path),
                                                      local_files_only=local_only)
        except Exception as exc:
            raise RuntimeConfigError(f"cannot load tokenizer {str(name_or_path)!r}: {_first_line(exc)}") from None
    else:
        tokenizer = name_or_path
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise RuntimeConfigError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token, which separates packed "
            "documents: set one (tokenizer.eos_token = '...') and save_pretrained it again"
        )
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what the tokenizer does (its full JSON for fast tokenizers, else its vocabulary)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(f"eos={tokenizer.eos_token_id};n={len(tokenizer)}".encode())
    return h.hexdigest()


def build_bpe_tokenizer(texts: Sequence[str] | Iterator[str], directory: str | os.PathLike, *,
                        vocab_size: int = 512, eos_token: str = "<|endoftext|>"):
    """Train a small byte-level BPE tokenizer on ``texts`` and save it as a ``PreTrainedTokenizerFast`` in
    ``directory`` (``AutoTokenizer.from_pretrained(directory)`` loads it): for offline demos and tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=eos_token)
    fast.save_pretrained(str(directory))
    return fast


# ----- packing ----------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    root = os.environ.get("SP_PLAN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sp-plan")
    return Path(root) / "packed"


class PackedTextDataset(torch.utils.data.Dataset):
    """Rows of ``seq_len`` tokens packed from a text dataset (see the module doc); map-style.

    Build with :meth:`build` (collective inside a process group). ``samples``: ``(seq_len,)`` int64
    token tensors (``positions="continuous"``) or ``{"input_ids", "position_ids"}`` (``"per_document"``); rows
    of a whole-document packing are dicts with ``labels`` too (padding at -100, so the loss skips it).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        meta = _read_meta(self.directory)
        self.meta = meta
        self.seq_len: int = meta["seq_len"]
        self.rows: int = meta["rows"]
        self.positions: str = meta["positions"]
        self.fingerprint: str = meta["key"]
        self.eos_token_id: int = meta["eos_token_id"]
        #: The tokenizer's padding token (its EOS when it has none) and its vocabulary size.
        self.pad_token_id: int = meta["pad_token_id"]
        self.vocab_size: int = meta["vocab_size"]
        self.max_token_id: int = meta["max_token_id"]
        #: How documents became rows (caches written before packing was an option are ``stream``).
        self.packing: str = meta.get("packing", "stream")
        #: Row tokens that are padding (0 for stream packing, whose rows are all data).
        self.padding_tokens: int = meta.get("padding_tokens", 0)
        self._tokens: np.ndarray | None = None
        self._valid: np.ndarray | None = None
        self._starts: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.rows * self.seq_len

    @property
    def padded(self) -> bool:
        """Whether rows hold padding (whole-document packings), whose labels are then ignored."""
        return self.meta["format"] == PADDED_PACK_FORMAT

    @property
    def padding_fraction(self) -> float:
        """Share of the row tokens that are padding: what the loss and the token counts leave out."""
        return self.padding_tokens / self.num_tokens if self.num_tokens else 0.0

    def lengths(self) -> LengthHistogram | None:
        """The dataset's document lengths (tokens with EOS), as recorded while tokenising (None for a cache
        written before they were recorded): what ``sp-plan train`` plans on."""
        bins = self.meta.get("lengths")
        if not bins:
            return None
        return make_histogram(bins, str(self.meta.get("source", "")), f"document lengths of {self.directory}")

    def _open(self) -> None:
        if self._tokens is None:
            self._tokens = np.memmap(self.directory / TOKENS_FILE, dtype=np.uint32, mode="r",
                                     shape=(self.rows, self.seq_len))
            if self.padded:
                self._valid = np.memmap(self.directory / VALID_FILE, dtype=np.uint8, mode="r",
                                        shape=(self.rows, self.seq_len))
            if self.positions == "per_document":
                self._starts = _map_int64(self.directory / STARTS_FILE)
                self._offsets = _map_int64(self.directory / OFFSETS_FILE)

    def __len__(self) -> int:
        return self.rows

    def position_ids(self, index: int) -> torch.Tensor:
        """Row ``index``'s positions: restarting at each document start (``per_document``), else 0..seq_len-1."""
        self._open()
        pos = np.arange(self.seq_len, dtype=np.int64)
        if self.positions == "per_document":
            starts = self._starts[self._offsets[index]:self._offsets[index + 1]]
            if len(starts):
                base = np.concatenate([[0], starts])[np.searchsorted(starts, pos, side="right")]
                pos = pos - base
        return torch.from_numpy(pos)

    def __getitem__(self, index: int):
        if not 0 <= index < self.rows:
            raise IndexError(index)
        self._open()
        ids = torch.from_numpy(self._tokens[index].astype(np.int64))
        if self.padded:  # padding carries ignored labels: out of the loss and the token counts
            valid = torch.from_numpy(self._valid[index].astype(np.bool_))
            sample = {"input_ids": ids, "labels": ids.masked_fill(~valid, IGNORE_INDEX)}
            if self.positions == "per_document":
                sample["position_ids"] = self.position_ids(index)
            return sample
        if self.positions == "per_document":
            return {"input_ids": ids, "position_ids": self.position_ids(index)}
        return ids

    def describe(self) -> str:
        m = self.meta
        if self.padded:
            tail = f"{self.packing} packing, {self.padding_fraction:.1%} padding"
        else:
            tail = f"{m['dropped_tokens']:,} tokens of the last partial row dropped"
        return (f"{m['documents']:,} documents ({m['source']}), {self.num_tokens:,} tokens in {self.rows:,} rows of "
                f"{self.seq_len:,} ({tail}); positions {self.positions}")

    @classmethod
    def build(cls, source, tokenizer, seq_len: int, *, text_column: str = "text", split: str = "train",
              positions: str = "continuous", packing: str = "stream", multiple: int = 1,
              cache_dir: str | os.PathLike | None = None, hf_cache_dir: str | os.PathLike | None = None,
              batch_size: int = 1000, log: Callable[[str], None] | None = None) -> PackedTextDataset:
        """Pack a text dataset into rows of ``seq_len``, or reuse its cached packing.

        ``source``: what :func:`load_text_dataset` takes (a path, a hub name or a ``datasets.Dataset``);
        ``tokenizer``: what :func:`load_tokenizer` takes. Collective when a process group is initialised:
        only rank 0 loads the dataset and the tokenizer and packs; every rank then maps the result, or
        raises rank 0's error. ``cache_dir``: where packed datasets live (default
        :func:`default_cache_dir`); ``hf_cache_dir``: the ``datasets`` cache for data files.

        ``packing`` (:mod:`sp_plan.cost_models.packing`, the planner's own function): ``stream`` (the default:
        documents concatenated and cut every ``seq_len`` tokens, no padding), or ``first_fit``/``sorted``
        (whole documents placed in rows, longer ones split into row-sized pieces that continue in order, each
        row's tail padded; ``multiple`` rounds every piece up with padding inside it, as per-document ring
        sharding over ring R needs with ``multiple = 2 R``). Padding has ignored labels.
        """
        if positions not in POSITION_MODES:
            raise RuntimeConfigError(f"positions={positions!r}: choose one of {', '.join(POSITION_MODES)}")
        if packing not in PACKINGS:
            raise RuntimeConfigError(f"packing={packing!r}: choose one of {', '.join(PACKINGS)}")
        if seq_len < 2:
            raise RuntimeConfigError(f"seq_len must be at least 2, got {seq_len}")
        if multiple < 1 or seq_len % multiple or (packing == "stream" and multiple != 1):
            raise RuntimeConfigError(f"multiple={multiple} must divide seq_len {seq_len} and applies to whole-document "
                                     "packings (first_fit, sorted) only")
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

        def make() -> str:
            dataset = load_text_dataset(source, split=split, text_column=text_column, cache_dir=hf_cache_dir)
            tok = load_tokenizer(tokenizer)
            spec = {"format": PACK_FORMAT, "dataset": getattr(dataset, "_fingerprint", None), "rows": len(dataset),
                    "text_column": text_column, "tokenizer": tokenizer_fingerprint(tok), "seq_len": seq_len,
                    "positions": positions}
            if packing != "stream":  # stream keeps its key: the caches of earlier versions stay valid
                spec.update(format=PADDED_PACK_FORMAT, packing=packing, multiple=multiple)
            key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
            directory = cache / f"packed-{key}"
            name = str(source if isinstance(source, (str, os.PathLike)) else "in-memory dataset")
            layout = _Layout(seq_len, positions, packing, multiple)
            if not (directory / META_FILE).is_file():
                _pack(dataset, tok, layout, text_column, directory, key, batch_size, name, log)
            elif "lengths" not in _read_meta(directory):  # written before lengths were recorded
                _record_lengths(dataset, tok, text_column, directory, batch_size, log)
            return str(directory)

        return cls(on_rank_zero(make, "packing the dataset"))


def on_rank_zero(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` on rank 0 only, its result (or its error, as a :class:`RuntimeConfigError`) broadcast to
    every rank; just ``fn()`` without a multi-rank process group."""
    alone = not (dist.is_initialized() and dist.get_world_size() > 1)
    box: list[Any] = [None]
    if alone or dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # every rank must learn why, not hang in the broadcast; one line either way
            message = str(exc) if isinstance(exc, RuntimeConfigError) else \
                f"{what} failed on rank 0: {type(exc).__name__}: {_first_line(exc)}"
            box[0] = ("error", message)
    if alone:
        status, value = box[0]
        if status == "error":
            raise RuntimeConfigError(value)
        return value
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RuntimeConfigError(value)
    return value


def _map_int64(file: Path) -> np.ndarray:
    """A read-only memory map of an int64 file (numpy cannot map an empty one)."""
    if file.stat().st_size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.memmap(file, dtype=np.int64, mode="r")


def _read_meta(directory: Path) -> dict[str, Any]:
    file = directory / META_FILE
    if not file.is_file():
        raise RuntimeConfigError(f"{directory} is not a packed dataset (no {META_FILE}); build it with "
                                 "PackedTextDataset.build")
    if file.stat().st_size > 1 << 20:
        raise RuntimeConfigError(f"{file} is too large to be a packed dataset's metadata")
    try:
        meta = json_loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise RuntimeConfigError(f"{file} is not valid JSON: {_first_line(exc)}") from None
    if meta.get("format") not in PACK_FORMATS:
        raise RuntimeConfigError(f"{directory} was packed with format {meta.get('format')}, this runtime reads "
                                 f"{' and '.join(map(str, PACK_FORMATS))}: delete it to rebuild")
    files = [(TOKENS_FILE, 4)] + ([(VALID_FILE, 1)] if meta["format"] == PADDED_PACK_FORMAT else [])
    for name, width in files:
        size = (directory / name).stat().st_size if (directory / name).is_file() else -1
        if size != meta["rows"] * meta["seq_len"] * width:
            raise RuntimeConfigError(f"{directory / name} has {size} bytes, expected "
                                     f"{meta['rows'] * meta['seq_len'] * width}: the cache is damaged, delete it to "
                                     "rebuild")
    return meta


def _batches(dataset, text_column: str, batch_size: int) -> Iterator[dict]:
    """The dataset's text column in batches; a file that is not UTF-8 (pyarrow decodes lazily, here) is one
    line naming the fix, not a UnicodeDecodeError from inside pyarrow."""
    batches = iter(dataset.select_columns([text_column]).iter(batch_size=batch_size))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise RuntimeConfigError(f"column {text_column!r} holds text that is not UTF-8 ({exc.reason} at byte "
                                     f"{exc.start} of a value): re-encode the data files as UTF-8") from None
        yield batch


class _Layout(NamedTuple):
    """What a packed cache's rows are: their length, position mode, packing and per-piece multiple."""

    seq_len: int
    positions: str
    packing: str
    multiple: int


def _documents(dataset, tokenizer, text_column: str, batch_size: int, counts: dict,
               lengths: LengthAccumulator) -> Iterator[list[int]]:
    """Every document's token ids (no EOS yet), counted, and its length with EOS fed to ``lengths``."""
    for batch in _batches(dataset, text_column, batch_size):
        texts = batch[text_column]
        if any(not isinstance(t, str) for t in texts):
            raise RuntimeConfigError(f"column {text_column!r} holds a non-string value (None?): clean the dataset")
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths.add(len(ids) + 1 for ids in encoded)
        for ids in encoded:
            counts["documents"] += 1
            counts["tokens"] += len(ids) + 1
            yield ids


def _fresh_tmp(directory: Path) -> Path:
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, directory: Path, meta: dict[str, Any]) -> None:
    """Write the metadata last, then move the finished directory into place in one rename."""
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    if directory.exists():  # another builder won the race with the same content
        shutil.rmtree(tmp, ignore_errors=True)
        return
    os.replace(tmp, directory)


def _no_rows(counts: dict, seq_len: int) -> RuntimeConfigError:
    return RuntimeConfigError(
        f"the dataset has {counts['tokens']:,} tokens ({counts['documents']:,} documents with EOS), fewer than "
        f"one sequence of {seq_len:,}: use a shorter sequence or more data")


def _common_meta(tokenizer, layout: _Layout, key: str, name: str, counts: dict, lengths: LengthAccumulator,
                 max_id: int) -> dict[str, Any]:
    eos = int(tokenizer.eos_token_id)
    return {"key": key, "seq_len": layout.seq_len, "positions": layout.positions,
            "documents": counts["documents"], "tokens": counts["tokens"], "eos_token_id": eos,
            "max_token_id": max_id, "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer),
            "pad_token_id": int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos),
            "source": name, "packing": layout.packing, "lengths": [list(b) for b in lengths.bins()]}


def _pack(dataset, tokenizer, layout: _Layout, text_column: str, directory: Path, key: str, batch_size: int,
          name: str, log) -> None:
    """Tokenise, pack and publish the cache directory atomically (stream: one pass; whole-document packings:
    tokenise to a temporary file, pack the lengths, copy the rows out of it)."""
    tmp = _fresh_tmp(directory)
    if log is not None:
        log(f"packing {len(dataset):,} documents into rows of {layout.seq_len:,} tokens ({layout.packing}) -> "
            f"{directory}")
    try:
        writer = _pack_stream if layout.packing == "stream" else _pack_whole_documents
        meta = writer(dataset, tokenizer, layout, text_column, tmp, key, batch_size, name)
        _publish(tmp, directory, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pack_stream(dataset, tokenizer, layout: _Layout, text_column: str, tmp: Path, key: str, batch_size: int,
                 name: str) -> dict[str, Any]:
    """One streaming pass with :func:`sp_plan.runtime.data.pack_documents`: the rows (and the document starts
    inside rows) of format 1, as every earlier version wrote them."""
    seq_len, eos = layout.seq_len, int(tokenizer.eos_token_id)
    per_document = layout.positions == "per_document"
    counts = {"documents": 0, "tokens": 0}
    lengths = LengthAccumulator()
    rows, max_id = 0, eos
    starts: list[np.ndarray] = []
    offsets = [0]
    with open(tmp / TOKENS_FILE, "wb") as out:
        docs = _documents(dataset, tokenizer, text_column, batch_size, counts, lengths)
        for row in pack_documents(docs, seq_len, separator=eos, reset_positions=per_document):
            ids = row["input_ids"].numpy()
            max_id = max(max_id, int(ids.max()))
            out.write(ids.astype(np.uint32).tobytes())
            if per_document:
                restarts = np.flatnonzero(row["position_ids"].numpy()[1:] == 0) + 1
                starts.append(restarts.astype(np.int64))
                offsets.append(offsets[-1] + len(restarts))
            rows += 1
    if rows == 0:
        raise _no_rows(counts, seq_len)
    if per_document:
        _write_starts(tmp, starts, offsets)
    meta = {"format": PACK_FORMAT, **_common_meta(tokenizer, layout, key, name, counts, lengths, max_id),
            "rows": rows, "dropped_tokens": counts["tokens"] - rows * seq_len, "padding_tokens": 0}
    return meta


def _write_starts(tmp: Path, starts: list[np.ndarray], offsets: list[int]) -> None:
    (np.concatenate(starts) if starts else np.zeros(0, np.int64)).tofile(tmp / STARTS_FILE)
    np.asarray(offsets, dtype=np.int64).tofile(tmp / OFFSETS_FILE)


def _tokenize_to_file(dataset, tokenizer, text_column: str, batch_size: int, file: Path, counts: dict,
                      lengths: LengthAccumulator) -> tuple[np.ndarray, int]:
    """Every document's tokens with EOS, back to back in ``file`` (uint32): the documents stay on disk, not in
    Python lists; returns their lengths (int64) and the largest token id."""
    eos = int(tokenizer.eos_token_id)
    sizes: list[np.ndarray] = []
    max_id = eos
    with open(file, "wb") as out:
        batch: list[np.ndarray] = []
        for ids in _documents(dataset, tokenizer, text_column, batch_size, counts, lengths):
            tokens = np.asarray([*ids, eos], dtype=np.uint32)
            max_id = max(max_id, int(tokens.max()))
            batch.append(tokens)
            if len(batch) >= batch_size:
                sizes.append(_flush(out, batch))
        sizes.append(_flush(out, batch))
    return np.concatenate(sizes), max_id


def _flush(out, batch: list[np.ndarray]) -> np.ndarray:
    """Write a batch of documents and empty it; their lengths."""
    for tokens in batch:
        out.write(tokens.tobytes())
    sizes = np.fromiter((len(t) for t in batch), dtype=np.int64, count=len(batch))
    batch.clear()
    return sizes


def _pack_whole_documents(dataset, tokenizer, layout: _Layout, text_column: str, tmp: Path, key: str,
                          batch_size: int, name: str) -> dict[str, Any]:
    """Format 2: documents placed in rows by :func:`sp_plan.cost_models.packing.pack` (the planner's packer,
    documents longer than a row split into pieces that continue in order), each piece followed by its padding
    to ``multiple``, each row's tail padded; the real tokens marked in :data:`VALID_FILE`. With per-document
    positions the piece starts (and the tail's, a document of its own) are the row's document starts."""
    seq_len = layout.seq_len
    counts = {"documents": 0, "tokens": 0}
    lengths = LengthAccumulator()
    documents_file = tmp / DOCUMENTS_FILE
    sizes, max_id = _tokenize_to_file(dataset, tokenizer, text_column, batch_size, documents_file, counts, lengths)
    if counts["tokens"] == 0:
        raise _no_rows(counts, seq_len)
    try:
        rows = pack(sizes.tolist(), seq_len, layout.packing, multiple=layout.multiple, split_long=True)
    except CostModelError as exc:
        raise RuntimeConfigError(str(exc)) from None
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # where each document's tokens begin in the file
    tokens = np.memmap(documents_file, dtype=np.uint32, mode="r")
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    per_document = layout.positions == "per_document"
    starts: list[np.ndarray] = []
    offsets = [0]
    with open(tmp / TOKENS_FILE, "wb") as out, open(tmp / VALID_FILE, "wb") as valid_out:
        for pieces in rows:
            ids, valid, row_starts = _fill_row(pieces, tokens, first, seq_len, pad)
            out.write(ids.tobytes())
            valid_out.write(valid.tobytes())
            if per_document:
                starts.append(row_starts)
                offsets.append(offsets[-1] + len(row_starts))
    del tokens
    documents_file.unlink()
    if per_document:
        _write_starts(tmp, starts, offsets)
    padding = len(rows) * seq_len - counts["tokens"]
    return {"format": PADDED_PACK_FORMAT, **_common_meta(tokenizer, layout, key, name, counts, lengths, max_id),
            "rows": len(rows), "dropped_tokens": 0, "padding_tokens": padding, "multiple": layout.multiple}


def _fill_row(pieces, tokens: np.ndarray, first: np.ndarray, seq_len: int,
              pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row: its token ids (uint32), its real-token mask (uint8) and its document starts after 0 (int64)."""
    ids = np.full(seq_len, pad, dtype=np.uint32)
    valid = np.zeros(seq_len, dtype=np.uint8)
    row_starts = []
    at = 0
    for piece in pieces:
        begin = int(first[piece.doc]) + piece.start
        ids[at:at + piece.length] = tokens[begin:begin + piece.length]
        valid[at:at + piece.length] = 1
        if at:
            row_starts.append(at)
        at += piece.padded
    if 0 < at < seq_len:  # the tail's padding: a document of its own
        row_starts.append(at)
    return ids, valid, np.asarray(row_starts, dtype=np.int64)


def _record_lengths(dataset, tokenizer, text_column: str, directory: Path, batch_size: int, log) -> None:
    """Add the document lengths to a cache written before they were recorded (one tokenising pass; the rows
    are not touched), replacing its metadata file atomically."""
    if log is not None:
        log(f"recording the document lengths of {directory} (packed by an earlier version)")
    counts = {"documents": 0, "tokens": 0}
    lengths = LengthAccumulator()
    for _ in _documents(dataset, tokenizer, text_column, batch_size, counts, lengths):
        pass
    meta = _read_meta(directory)
    meta.update(lengths=[list(b) for b in lengths.bins()], packing=meta.get("packing", "stream"),
                padding_tokens=meta.get("padding_tokens", 0))
    tmp = directory / f".{META_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, directory / META_FILE)


def check_vocabulary(dataset: PackedTextDataset, vocab_size: int) -> None:
    """Refuse a packed dataset whose token ids do not fit the model's embedding."""
    if dataset.max_token_id >= vocab_size:
        raise RuntimeConfigError(
            f"the tokenizer produces token id {dataset.max_token_id} but the model's vocabulary has {vocab_size} "
            f"entries: build the model with vocab_size >= {dataset.meta.get('vocab_size', dataset.max_token_id + 1)}"
        )


# ----- the global batch stream --------------------------------------------------------------------------------


def collate(samples: Sequence[Any]) -> Any:
    """Stack tensors (and dicts of tensors) into a batch."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {k: torch.stack([s[k] for s in samples]) for k in first}
    return torch.stack(list(samples))


class GlobalBatches:
    """Deterministic, resumable per-step micro-batches for one data-parallel rank (see the module doc).

    ``dataset``: map-style (``len`` and ``[i]``), e.g. :class:`PackedTextDataset` or
    :class:`sp_plan.runtime.data.TokenWindows`. Each :meth:`next_step` returns this rank's ``grad_accum``
    micro-batches of ``micro_batch`` sequences and advances the global position by
    :attr:`sequences_per_step`. :meth:`state_dict` / :meth:`load_state_dict` carry the position
    (sequences consumed) and what it refers to.
    """

    def __init__(self, dataset, *, micro_batch: int, grad_accum: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, collate_fn: Callable[[Sequence[Any]], Any] = collate) -> None:
        if micro_batch < 1 or grad_accum < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise RuntimeConfigError(f"invalid batch shape: micro_batch={micro_batch}, grad_accum={grad_accum}, "
                                     f"dp_rank={dp_rank} of dp_size={dp_size}")
        self.num_sequences = len(dataset)
        if self.num_sequences == 0:
            raise RuntimeConfigError("the dataset is empty")
        self.dataset, self.seed, self.shuffle, self.collate_fn = dataset, seed, shuffle, collate_fn
        self.micro_batch, self.grad_accum, self.dp_rank, self.dp_size = micro_batch, grad_accum, dp_rank, dp_size
        self.position = 0
        self._epoch = -1
        self._order: torch.Tensor | None = None

    @classmethod
    def for_setup(cls, setup, dataset, *, seed: int = 0, shuffle: bool = True, **kwargs) -> GlobalBatches:
        """The stream for an :class:`sp_plan.runtime.auto.AutoConfigured` run: its micro-batch, accumulation and
        data-parallel coordinates (SP and TP ranks of one group get the same batches)."""
        return cls(dataset, micro_batch=setup.train.micro_batch, grad_accum=setup.train.grad_accum,
                   dp_rank=setup.dp_rank, dp_size=setup.dp_size, seed=seed, shuffle=shuffle, **kwargs)

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    @property
    def epoch(self) -> int:
        """The epoch the next sequence comes from."""
        return self.position // self.num_sequences

    def index(self, position: int) -> int:
        """The dataset index at global stream ``position``."""
        epoch, offset = divmod(position, self.num_sequences)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            self._order = torch.randperm(self.num_sequences, generator=torch.Generator().manual_seed(self.seed + epoch))
            self._epoch = epoch
        return int(self._order[offset])

    def next_step(self) -> list[Any]:
        """This rank's micro-batches of the next optimizer step (the position advances past the whole step)."""
        first = self.position + self.dp_rank * self.micro_batch * self.grad_accum
        micro = []
        for m in range(self.grad_accum):
            start = first + m * self.micro_batch
            micro.append(self.collate_fn([self.dataset[self.index(p)] for p in range(start, start + self.micro_batch)]))
        self.position += self.sequences_per_step
        return micro

    def state_dict(self) -> dict[str, Any]:
        return {"sequences_consumed": self.position, "num_sequences": self.num_sequences, "seed": self.seed,
                "shuffle": self.shuffle, "fingerprint": getattr(self.dataset, "fingerprint", None)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        differ = [f"{k}: checkpoint {state.get(k)!r} vs now {v!r}" for k, v in self.state_dict().items()
                  if k != "sequences_consumed" and state.get(k) != v]
        if differ:
            raise RuntimeConfigError(
                "the checkpoint's data position refers to other data (" + "; ".join(differ) + "): resume with the same "
                "dataset, tokenizer, sequence length and seed"
            )
        position = state.get("sequences_consumed")
        if not isinstance(position, int) or position < 0:
            raise RuntimeConfigError(f"invalid data position in the checkpoint: {position!r}")
        self.position = position
