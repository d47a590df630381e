"""Flags shared by every command that describes a run (estimate, plan, capacity, validate).

One definition keeps spelling, defaults and validation identical across commands.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from sp_plan.cost_models.topology.spec import MAX_GPUS_PER_NODE
from sp_plan.cost_models import data, degrees
from sp_plan.cost_models.errors import CostModelError, explain_validation_error
from sp_plan.cost_models.gpu_spec import GPUSpec, get_gpu_preset
from sp_plan.cost_models.layout import Layout
from sp_plan.cost_models.memory.assumptions import MemoryAssumptions
from sp_plan.cost_models.model_spec import ModelSpec, load_model
from sp_plan.cost_models.train_spec import MAX_STAGES, MAX_VIRTUAL_STAGES, TrainSpec
from sp_plan.cost_models.units import MAX_SEQ_LEN, parse_token_count

from sp_plan.cli.autoconfig import load_config_file
from sp_plan.cli.hub import is_hub_id, load_hub_model

if TYPE_CHECKING:
    from sp_plan.cost_models.data_balance import DataShape
    from sp_plan.cost_models.profile import CostProfile
    from sp_plan.cost_models.topology import Topology


class TokenCountType(click.ParamType):
    """Accepts 131072, 128K, 1M; rejects anything else (and anything above ``maximum``) with the project's
    message. Every token count on the command line uses it, so all of them take K/M suffixes."""

    name = "TOKENS"

    def __init__(self, what: str = "sequence length", maximum: int = MAX_SEQ_LEN) -> None:
        self.what = what
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_token_count(value, self.what, self.maximum)
        except CostModelError as exc:
            self.fail(str(exc), param, ctx)


SEQ_LEN = TokenCountType()


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, refusing NaN: every comparison with NaN is false, so FloatRange(0, 0.9) lets
    ``nan`` through (a probe then ran with a NaN time budget, a plan kept NaN headroom)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        result = super().convert(value, param, ctx)
        if result is not None and not math.isfinite(result):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return result


#: Commands that search the memory options and the micro-batch unless they are typed.
SEARCHING_COMMANDS = frozenset({"plan", "capacity"})


class SearchedOption(click.Option):
    """An option that plan and capacity search unless it is typed: their --help says so instead of showing a
    default, which only estimate and validate use."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        if ctx.command.name not in SEARCHING_COMMANDS:
            return super().get_help_record(ctx)
        shown, self.show_default = self.show_default, False
        try:
            record = super().get_help_record(ctx)
        finally:
            self.show_default = shown
        if record is None:
            return None
        return record[0], f"{record[1]}  [searched unless given]".strip()


def model_options(func: Callable) -> Callable:
    """--model, --seq-len (required), --mode, --micro-batch, --dtype and the memory options."""
    return _model_options(func, seq_len_required=True)


def model_options_optional_seq(func: Callable) -> Callable:
    """As :func:`model_options`, with --seq-len optional (capacity questions)."""
    return _model_options(func, seq_len_required=False)


#: Checkpointing and the memory techniques: shared by the planning commands and ``validate``.
#: Each technique is a --x/--no-x pair: plan and capacity search it unless either spelling is typed,
#: which pins it on or off (see :func:`pinned`); estimate and validate take the value as given.
MEMORY_TECHNIQUE_OPTIONS = (
    click.option("--offload-optimizer/--no-offload-optimizer", default=False,
                 help="Keep optimizer states in host memory (plan/capacity: pin on or off; default: searched)."),
    click.option("--offload-params/--no-offload-params", default=False,
                 help="Keep parameter shards in host memory (ZeRO-3; plan/capacity: pin on or off)."),
    click.option("--offload-checkpoints/--no-offload-checkpoints", default=False,
                 help="Move checkpointed hidden states to host memory (plan/capacity: pin on or off)."),
    click.option(
        "--checkpointing",
        type=click.Choice(["none", "selective", "full"]),
        default="full",
        show_default=True,
        cls=SearchedOption,
        help="Activation checkpointing per transformer block.",
    ),
    click.option("--tiled-mlp/--no-tiled-mlp", default=False,
                 help="Run the FFN over sequence tiles (plan/capacity: pin on or off)."),
    click.option("--tiled-loss/--no-tiled-loss", default=False,
                 help="Compute logits and cross-entropy in chunks (plan/capacity: pin on or off)."),
)

class IntListType(click.ParamType):
    """A comma-separated list of positive integers (``7,8,8,7``), bounded in length."""

    name = "N,N,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        if not parts or len(parts) > MAX_STAGES or not all(p.isdigit() and int(p) >= 1 for p in parts):
            self.fail(f"{value!r} is not a comma-separated list of positive layer counts (e.g. 7,8,8,7; at most "
                      f"{MAX_STAGES} entries)", param, ctx)
        return tuple(int(p) for p in parts)


#: Pipeline schedule options (used when --pp > 1): estimate takes them as given; plan and capacity search the
#: schedule and the virtual stages unless typed.
PIPELINE_OPTIONS = (
    click.option("--schedule", "pipeline_schedule", type=click.Choice(["1f1b", "interleaved_1f1b", "zero_bubble"]),
                 default=None, cls=SearchedOption,
                 help="Pipeline schedule with --pp > 1: 1f1b, interleaved_1f1b (with --virtual-stages), zero_bubble "
                      "(ZB-H1). Default: 1f1b, or interleaved_1f1b when --virtual-stages > 1."),
    click.option("--virtual-stages", type=click.IntRange(1, MAX_VIRTUAL_STAGES), default=1, show_default=True,
                 cls=SearchedOption, help="Model chunks per pipeline stage (interleaved 1F1B)."),
    click.option("--stage-layers", type=IntListType(), default=None,
                 help="Layers of each pipeline stage, first to last, e.g. 7,8,8,7 (must sum to the model's layers; "
                      "default: a split balancing the stages' time, the last stage carrying the LM head)."),
)


#: The software stack and calibration a prediction assumes (estimate, plan, capacity).
STACK_OPTIONS = (
    click.option(
        "--stack",
        "stack",
        default=None,
        metavar="NAME|FILE",
        help="Software stack the run uses: sp-plan (this runtime; the default), hf-deepspeed (transformers + "
             "DeepSpeed ZeRO/ALST), torchtitan (FSDP2 + torch context parallel), or a stack YAML file "
             "(cost_models/data/stacks/ shows the format). Default: the calibration's stack, else sp-plan.",
    ),
    click.option(
        "--calibration",
        "calibration",
        default=None,
        metavar="FILE",
        help="Calibration YAML written by `sp-plan calibrate` from measured runs: its overrides apply on top of "
             "the stack (kernel overrides only on the GPU it was fitted on).",
    ),
)


#: The training data's lengths (issue 32): plan on the packed rows of the user's distribution.
DATA_OPTIONS = (
    click.option("--lengths", "lengths", default=None, metavar="FILE|PRESET",
                 help="Document-length distribution of the training data: a file from `sp-plan lengths`, a CSV "
                      "with header length,count, or a preset (`sp-plan lengths --show PRESET`). Documents are "
                      "packed into --seq-len rows with document masking, and attention is priced on the packed "
                      "rows' busiest rank."),
    click.option("--packing", type=click.Choice(["stream", "first_fit", "sorted"]), default=None,
                 help="How --lengths documents become rows: stream (concatenate and cut), first_fit (whole "
                      "documents, data order), sorted (first-fit longest first). Default: first_fit or sorted, "
                      "searched with the layout (the fastest in useful tokens/s); stream cuts documents, so it "
                      "is priced only when given."),
    click.option("--sharding", "sequence_sharding", type=click.Choice(["auto", "zigzag", "per_document"]),
                 default=None,
                 help="How a packed row is split over the ring ranks: zigzag over the row, per_document (every "
                      "document in 2 x ring head-tail chunks), or auto (the faster at each ring degree; the "
                      "default). Needs --lengths."),
)


def memory_technique_options(func: Callable) -> Callable:
    for option in reversed(MEMORY_TECHNIQUE_OPTIONS):
        func = option(func)
    return func


def _model_options(func: Callable, seq_len_required: bool) -> Callable:
    options = [
        click.option("--model", "model_name", required=True,
                     help="Preset name, path to a HF config.json (or its folder), or a Hugging Face hub id org/name "
                          "(only its config.json is fetched, into the HF cache; HF_HUB_OFFLINE=1 reads the cache)."),
        click.option("--seq-len", type=SEQ_LEN, required=seq_len_required,
                     help="Tokens per sequence: 131072, 128K, 1M."),
        click.option("--mode", type=click.Choice(["train", "prefill"]), default="train", show_default=True),
        click.option("--micro-batch", type=click.IntRange(1, 1 << 16), default=1, show_default=True,
                     cls=SearchedOption),
        click.option("--grad-accum", type=click.IntRange(1, 1 << 16), default=1, show_default=True,
                     cls=SearchedOption),
        click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True),
        click.option(
            "--optimizer",
            type=click.Choice(["adamw", "adamw_bf16"]),
            default="adamw",
            show_default=True,
            help="adamw: fp32 master + moments (12 B/param); adamw_bf16: bf16 moments, no master (4 B/param).",
        ),
        click.option("--zero", "zero_stage", type=click.IntRange(0, 3), default=3, show_default=True,
                     cls=SearchedOption),
        *MEMORY_TECHNIQUE_OPTIONS,
        click.option(
            "--attention",
            "attention_kernel",
            type=click.Choice(["flash", "materialized"]),
            default="flash",
            show_default=True,
        ),
        click.option("--document-length", type=SEQ_LEN, default=None,
                     help="Packed sequences with document masking: typical document length in tokens "
                          "(attention stays inside a document; default: one document per sequence)."),
        *DATA_OPTIONS,
        *PIPELINE_OPTIONS,
        click.option("--fp8-linears", is_flag=True, help="Float8 linear layers (torchao / TransformerEngine style)."),
        click.option("--compiled", is_flag=True, help="The transformer blocks run under torch.compile."),
        click.option(
            "--assume",
            "assume",
            multiple=True,
            metavar="KEY=VALUE",
            help="Override a memory-model assumption (repeatable; on top of --stack and --calibration), e.g. "
                 "--assume norm_implementation=eager (HF's eager RMSNorm) or --assume fragmentation_fraction=0.1; "
                 "keys and meanings: docs/memory_model.md.",
        ),
        *STACK_OPTIONS,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def hardware_options(func: Callable) -> Callable:
    """--gpus, --gpus-per-node, --gpu, --topology. --gpus is optional: capacity questions search it,
    and plan/estimate default to the --topology machine (see :func:`build_cluster`)."""
    options = [
        click.option("--gpus", type=click.IntRange(1, 1 << 20), default=None,
                     help="Total number of GPUs (default with --topology: all GPUs it describes)."),
        click.option(
            "--gpus-per-node",
            type=click.IntRange(1, MAX_GPUS_PER_NODE),
            default=None,
            help="GPUs per node (default: min(8, --gpus)).",
        ),
        click.option("--gpu", "gpu_name", default="h100-80gb", show_default=True, help="GPU preset."),
        click.option(
            "--topology",
            "topology_ref",
            default=None,
            help="Topology preset (e.g. dgx-h100, dgx-h100@roce-400:8) or YAML file (from `sp-plan probe`); "
            "overrides --gpu and --gpus-per-node. Default: the natural machine for --gpu.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


#: ``--ep``: the expert-parallel degree, a layout field that is not a registered degree (it regroups ranks of the
#: shard group and does not multiply the world; see :class:`~sp_plan.cost_models.layout.Layout`).
EP_HELP = ("Expert-parallel degree (MoE models): the innermost ranks of the ZeRO/FSDP shard group that split "
           "the routed experts; must divide the experts and dp_shard x ring x ulysses; does not use more GPUs.")


def layout_options(func: Callable) -> Callable:
    """One option per registered layout degree, innermost first (--tp, --ulysses, --ring, --dp-shard,
    --dp-replicate today; the fill degree, dp_shard, takes the rest by default), then --ep."""
    func = click.option("--ep", "ep", type=click.IntRange(1, degrees.MAX_DEGREE), default=None, help=EP_HELP)(func)
    for name in reversed(degrees.innermost_first()):
        func = click.option(degrees.degree(name).flag, name, type=int, default=None,
                            help=degrees.degree(name).help)(func)
    return func


def layout_keys() -> tuple[str, ...]:
    """The layout's pins, innermost first: the registered degrees, then ``ep`` (the command-line pins and
    their order in help texts)."""
    return (*degrees.innermost_first(), "ep")


def check_output_path(path: str | Path | None, option: str) -> None:
    """Refuse an output path that cannot be written *before* the work that produces it (a plan search or a
    sweep can take seconds): its directory must exist and the path must not be a directory. The write
    itself is atomic (:mod:`sp_plan.cost_models.atomic_io`) and reports the remaining failures (permissions)."""
    if path is None or str(path) == "-":  # "-": standard output
        return
    if not str(path).strip():
        raise CostModelError(f"{option} is empty: give a file name")
    target = Path(path).expanduser()
    if target.is_dir():
        raise CostModelError(f"{option} {target} is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise CostModelError(f"{option} {target}: the directory {parent} {what}; create it first or choose "
                             "another path")


def build_model(model_name: str) -> ModelSpec:
    """A preset, a local config.json (or its folder), or a Hugging Face hub id ``org/name`` whose
    config.json is fetched into the HF cache (:mod:`sp_plan.cli.hub`); config files are read as transformers
    reads them when it is installed (:mod:`sp_plan.cli.autoconfig`)."""
    if is_hub_id(model_name):
        return load_hub_model(model_name.strip())
    found = data.resolve("models", model_name)
    if found.path is not None:
        return load_config_file(found.path)
    return load_model(model_name)


#: Pipeline schedules that only mean something with pipeline stages (1f1b is also the no-pipeline default).
PIPELINED_SCHEDULES = frozenset({"interleaved_1f1b", "zero_bubble"})


def check_pipeline_flags_need_pp(pp: int, pipeline_schedule: str | None, virtual_stages: int) -> None:
    """Refuse --virtual-stages N > 1 or --schedule interleaved_1f1b|zero_bubble on a layout without pipeline
    stages (pp=1): the estimate would silently price a plain run and drop what was asked for."""
    if pp != 1:
        return
    if virtual_stages > 1:
        raise CostModelError(f"--virtual-stages {virtual_stages} splits pipeline stages into chunks, but pp=1 (no "
                             "pipeline); add --pp N with N > 1, or drop --virtual-stages")
    if pipeline_schedule in PIPELINED_SCHEDULES:
        raise CostModelError(f"--schedule {pipeline_schedule} is a pipeline schedule, but pp=1 (no pipeline); add "
                             "--pp N with N > 1, or drop --schedule")


#: Options only a training step has (click parameter -> flag): a prefill runs no backward and keeps no gradients
#: or optimizer state, so these changed nothing and the figures came out as if they had not been typed.
TRAINING_ONLY_OPTIONS = {"optimizer": "--optimizer", "offload_optimizer": "--offload-optimizer",
                         "offload_checkpoints": "--offload-checkpoints", "checkpointing": "--checkpointing",
                         "tiled_loss": "--tiled-loss"}


def _refuse_training_only_under_prefill(kwargs: dict[str, Any]) -> None:
    """A training-only flag typed with ``--mode prefill`` is refused rather than ignored."""
    ctx = click.get_current_context(silent=True)
    if kwargs.get("mode") != "prefill" or ctx is None:
        return
    typed = [TRAINING_ONLY_OPTIONS[name] for name in pinned(ctx, tuple(TRAINING_ONLY_OPTIONS))]
    if typed:
        raise CostModelError(f"{', '.join(typed)}: training only; --mode prefill runs no backward and keeps no "
                             "gradients or optimizer state, so it would change nothing: drop "
                             f"{'it' if len(typed) == 1 else 'them'}, or plan --mode train")


def data_shape(lengths: str | None, packing: str | None, sharding: str | None,
               document_length: int | None) -> "DataShape | None":
    """The ``--lengths`` distribution with its packing and sharding rule (None without ``--lengths``)."""
    if lengths is None:
        given = [flag for flag, value in (("--packing", packing), ("--sharding", sharding)) if value is not None]
        if given:
            raise CostModelError(f"{' and '.join(given)} shape how documents are packed and sharded: give the data's "
                                 "lengths with --lengths FILE|PRESET (see `sp-plan lengths --help`)")
        return None
    if document_length is not None:
        raise CostModelError("--document-length and --lengths both describe the documents: give one (--lengths "
                             "prices the packed rows of the whole distribution)")
    from sp_plan.cost_models.data_balance import DataShape
    from sp_plan.cost_models.lengths import load_lengths

    histogram = load_lengths(lengths)
    return DataShape(bins=histogram.bins, packing=packing or "auto", sharding=sharding or "auto",
                     source=histogram.source or lengths)


def build_train(**kwargs: Any) -> TrainSpec:
    _refuse_training_only_under_prefill(kwargs)
    data = data_shape(kwargs.pop("lengths", None), kwargs.pop("packing", None), kwargs.pop("sequence_sharding", None),
                      kwargs.get("document_length"))
    if data is not None:
        kwargs["data"] = data
    if "pipeline_schedule" in kwargs and kwargs["pipeline_schedule"] is None:  # --schedule not given
        kwargs["pipeline_schedule"] = "interleaved_1f1b" if kwargs.get("virtual_stages", 1) > 1 else "1f1b"
    try:
        return TrainSpec(**kwargs)
    except ValidationError as exc:
        raise explain_validation_error(exc, "training options") from exc


def build_gpu(gpu_name: str) -> GPUSpec:
    return get_gpu_preset(gpu_name)


def build_topology(gpus: int | None, gpus_per_node: int | None, gpu_name: str, topology_ref: str | None) -> "Topology":
    """The cluster: a preset or file resized to ``gpus`` (as described when None), or the natural
    machine for ``gpu_name``.

    Multi-node jobs must fill whole nodes: a plan for 12 GPUs on 8-GPU nodes is almost always a typo.
    """
    from sp_plan.cost_models.topology import default_topology, load_topology
    from sp_plan.cost_models.topology.presets import natural_gpus_per_node

    if topology_ref is not None:  # "" too: an empty --topology is a mistake to report, not "no topology"
        if not topology_ref.strip():
            from sp_plan.cost_models.topology import preset_names

            raise CostModelError(f"--topology is empty: give a preset ({', '.join(preset_names())}) or a topology "
                                 "YAML file, or leave the option out")
        topology = load_topology(topology_ref, gpus, gpus_per_node)
        _check_gpu_matches(gpu_name, topology, topology_ref)
    else:
        if gpus is None:
            raise click.UsageError("Missing option '--gpus' (or give --topology PRESET|FILE)")
        per_node = gpus_per_node or min(natural_gpus_per_node(gpu_name), gpus)
        topology = default_topology(gpu_name, gpus, per_node)
    per_node = topology.gpus_per_node
    if gpus is not None and gpus > per_node and gpus % per_node:
        raise CostModelError(
            f"--gpus {gpus} does not fill whole nodes of {per_node} GPUs; use a multiple of {per_node}"
        )
    return topology


def _check_gpu_matches(gpu_name: str, topology: "Topology", topology_ref: str) -> None:
    """A --gpu typed next to a --topology of another GPU was silently ignored (the topology names its GPU):
    refuse the contradiction instead of planning for a GPU the user did not ask for."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or not pinned(ctx, ("gpu_name",)):
        return
    def key(name: str) -> str:  # a shipped GPU by its canonical name, a topology's own GPU by its name
        return data.canonical("gpus", name) or name.strip().lower()

    if key(gpu_name) == key(topology.gpu.name):
        return
    if data.canonical("gpus", gpu_name) is None:  # a typo must not pass because neither name is shipped
        raise CostModelError(f"{data.unknown_name('gpus', gpu_name)}; --topology {topology_ref} describes its GPUs "
                             f"({topology.gpu.name}): drop --gpu")
    raise CostModelError(f"--gpu {gpu_name} contradicts --topology {topology_ref}, whose GPUs are "
                         f"{topology.gpu.name}; drop --gpu (the topology names its GPU) or give a topology of "
                         f"{gpu_name}")


def build_cluster(gpus: int | None, gpus_per_node: int | None, gpu_name: str,
                  topology_ref: str | None) -> tuple["Topology", int]:
    """The topology and the GPU count to plan for: --gpus, or all GPUs of the --topology machine."""
    if gpus is None and topology_ref is None:
        raise click.UsageError("Missing option '--gpus' (or give --topology PRESET|FILE to use the machine "
                               "it describes)")
    topology = build_topology(gpus, gpus_per_node, gpu_name, topology_ref)
    return topology, gpus if gpus is not None else topology.num_gpus


def build_assume(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Validated memory-assumption overrides from ``--assume KEY=VALUE`` pairs, as typed values (an empty
    dict when there are none). They apply on top of the stack and calibration (see :func:`build_profile`)."""
    if not pairs:
        return {}
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise CostModelError(f"--assume {pair!r}: expected KEY=VALUE, e.g. --assume norm_implementation=eager")
        if key not in MemoryAssumptions.model_fields:
            raise CostModelError(f"--assume {key}: unknown assumption; known: {', '.join(MemoryAssumptions.model_fields)}")
        values[key] = value.strip()
    try:
        parsed = MemoryAssumptions(**values)
    except ValidationError as exc:
        raise explain_validation_error(exc, "--assume") from exc
    return {key: getattr(parsed, key) for key in values}


def build_profile(gpu_name: str, stack: str | None, calibration: str | None,
                  assume: dict[str, Any] | None = None) -> "CostProfile":
    """The prediction's :class:`~sp_plan.cost_models.profile.CostProfile` for ``gpu_name``: ``--stack`` (or the
    calibration's stack, else sp-plan), the GPU's kernel model, ``--calibration``, then ``--assume``."""
    from sp_plan.cost_models.profile import resolve_profile

    return resolve_profile(gpu_name, stack, calibration, assume or None)


def build_layout(gpus: int, **degrees: int | None) -> Layout:
    return Layout.for_world(gpus, **degrees)


TRAIN_KEYS = (
    "seq_len",
    "mode",
    "micro_batch",
    "grad_accum",
    "dtype",
    "optimizer",
    "zero_stage",
    "offload_optimizer",
    "offload_params",
    "offload_checkpoints",
    "checkpointing",
    "tiled_mlp",
    "tiled_loss",
    "attention_kernel",
    "document_length",
    "lengths",
    "packing",
    "sequence_sharding",
    "fp8_linears",
    "compiled",
    "pipeline_schedule",
    "virtual_stages",
    "stage_layers",
)


#: Memory options the planner searches unless the user pins them on the command line.
SEARCHABLE_OPTIONS = ("zero_stage", "checkpointing", "offload_checkpoints", "tiled_loss", "tiled_mlp",
                      "offload_optimizer", "offload_params", "pipeline_schedule", "virtual_stages")


def pinned(ctx: click.Context, names: tuple[str, ...]) -> dict[str, Any]:
    """The options among ``names`` the user set explicitly (command line or environment), with values.

    Planning commands search everything the user left at its default; what they typed is a constraint.
    """
    from click.core import ParameterSource

    explicit = {ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT}
    return {n: ctx.params[n] for n in names if n in ctx.params and ctx.get_parameter_source(n) in explicit}


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate click's keyword arguments into TrainSpec fields and layout degrees."""
    train = {k: options[k] for k in TRAIN_KEYS if k in options}
    layout = {k: options[k] for k in layout_keys() if k in options}
    return train, layout
