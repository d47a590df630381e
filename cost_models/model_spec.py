"""Transformer architecture description: presets, HF ``config.json`` loading (parsed by
:mod:`sp_plan.cost_models.hf_config`), parameter counts.

Parameter counts are derived from the architecture, never typed in: the planner's memory figures are
only as good as this count, and the tests check it against each model's published total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, ValidationError, model_serializer, model_validator

from . import data
from .errors import CostModelError, explain_validation_error
from .hf_config import check_sizes_before_parsing, parse_config_text, spec_fields
from .memo import hash_once
from .moe import MLASpec, MoESpec

#: ``swiglu``: a gated MLP (gate, up and down matrices), whatever its gate's nonlinearity: SiLU (Llama) or
#: GELU-tanh (Gemma's GeGLU) have the same three matrices, FLOPs and saved tensors. ``gelu``: two matrices.
Activation = Literal["swiglu", "gelu"]
Norm = Literal["rmsnorm", "layernorm"]
#: ``alibi``: linear attention biases computed inside the attention kernel (MPT, BLOOM): no parameters and
#: no rotary tables.
PositionEmbedding = Literal["rope", "learned", "alibi"]


#: ModelSpec fields left out of its serialization when unset (see ``ModelSpec._omit_absent_sparse_parts``).
_OPTIONAL_SPARSE_FIELDS = ("published_active_params", "moe", "mla")


class ModelSpec(BaseModel):
    """A decoder-only transformer, as far as memory, FLOPs and communication are concerned."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: Hashed once: the cost model's memo tables key on the model (:func:`sp_plan.cost_models.memo.hash_once`).
    __slots__ = ("_hash",)
    __hash__ = hash_once

    name: str = Field(min_length=1, max_length=200)
    num_layers: int = Field(ge=1, le=10_000)
    hidden_size: int = Field(ge=1, le=1 << 20)
    num_heads: int = Field(ge=1, le=1 << 14)
    num_kv_heads: int = Field(ge=1, le=1 << 14)
    head_dim: int = Field(ge=1, le=1 << 14)
    ffn_hidden_size: int = Field(ge=1, le=1 << 22)
    vocab_size: int = Field(ge=1, le=1 << 24)
    tied_embeddings: bool = False
    activation: Activation = "swiglu"
    norm: Norm = "rmsnorm"
    position_embedding: PositionEmbedding = "rope"
    #: Learned absolute position embeddings add ``max_position_embeddings x hidden`` parameters.
    max_position_embeddings: int = Field(default=0, ge=0, le=1 << 30)
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    #: Per-head RMSNorm on queries and keys (Qwen3); adds 2 x head_dim parameters per layer.
    qk_norm: bool = False
    #: Hidden-size norms per layer beyond the two pre-norms (Gemma 2/3 also normalise the attention and
    #: MLP outputs: 2 more). Counted in the parameters and in the norms' streaming traffic.
    extra_norms_per_layer: int = Field(default=0, ge=0, le=8)
    #: Sliding-window attention: a query sees itself and the ``sliding_window - 1`` keys before it (HF's
    #: convention). ``None``: full causal attention in every layer.
    sliding_window: int | None = Field(default=None, ge=1, le=1 << 30)
    #: How many layers use the window (the others attend globally): Gemma 2 alternates, Gemma 3 has 5
    #: local to 1 global. ``None`` with a window: every layer (Mistral v0.1). The costs do not depend on
    #: which layers they are, only how many.
    sliding_window_layers: int | None = Field(default=None, ge=0, le=10_000)
    #: Dropout after attention softmax and on the hidden states; non-zero values make the layer save
    #: one-byte masks for backward (Megatron's GPT accounting). Modern LLM pre-training uses 0.
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    #: The total reported by the model's authors, for cross-checking the derived count (not used
    #: in any computation).
    published_params: int | None = Field(default=None, ge=1)
    #: The authors' active-parameter count (MoE), for cross-checking :attr:`active_params` only.
    published_active_params: int | None = Field(default=None, ge=1)
    #: Mixture-of-experts FFN of the sparse layers (``None``: every FFN is dense); see :mod:`.moe`.
    moe: MoESpec | None = None
    #: Multi-head latent attention (``None``: ordinary grouped-query attention); see :mod:`.moe`.
    mla: MLASpec | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_sparse_parts(self, handler, info: SerializationInfo) -> dict:
        """A dense model serializes exactly as before MoE/MLA existed (plans, exports and recorded presets
        keep their keys): the optional sparse parts appear only when set."""
        out = handler(self)
        for key in _OPTIONAL_SPARSE_FIELDS:
            if out.get(key, 0) is None:
                del out[key]
        return out

    @model_validator(mode="after")
    def _sparse_parts_consistent(self) -> ModelSpec:
        if self.moe is not None:
            outside = [i for i in self.moe.dense_layers if i >= self.num_layers]
            if outside:
                raise ValueError(f"moe.dense_layers {outside} are beyond num_layers={self.num_layers}")
            if self.moe.moe_layer_count(self.num_layers) < 1:
                raise ValueError("moe.dense_layers lists every layer; drop the moe section for a dense model")
        if self.mla is not None and (self.num_kv_heads != self.num_heads or self.head_dim != self.mla.qk_head_dim):
            raise ValueError(
                f"an MLA model attends with num_kv_heads = num_heads ({self.num_heads}) and head_dim = qk_nope + "
                f"qk_rope = {self.mla.qk_head_dim} (the latent is up-projected per head); "
                f"got num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}")
        return self

    @model_validator(mode="after")
    def _heads_consistent(self) -> "ModelSpec":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(grouped-query attention shares each KV head among a whole number of query heads)"
            )
        if self.position_embedding == "learned" and self.max_position_embeddings == 0:
            raise ValueError("learned position embeddings need max_position_embeddings > 0")
        if self.sliding_window_layers is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_window_layers needs a sliding_window (the window those layers use)")
            if self.sliding_window_layers > self.num_layers:
                raise ValueError(f"sliding_window_layers={self.sliding_window_layers} exceeds num_layers="
                                 f"{self.num_layers}")
        return self

    # ----- derived sizes -------------------------------------------------------------------
    def architecture_differences(self, other: ModelSpec) -> list[str]:
        """``field: mine != other's`` for every field but the name that differs: a plan made from one
        config.json and a run or export given another must say which sizes disagree, not train the other one."""
        mine, theirs = self.model_dump(exclude={"name"}), other.model_dump(exclude={"name"})
        return [f"{key}: {mine.get(key)!r} != {theirs.get(key)!r}" for key in sorted(mine.keys() | theirs.keys())
                if mine.get(key) != theirs.get(key)]

    def other_model_problem(self, other: ModelSpec, given: str) -> str | None:
        """The one-line refusal of ``other`` (``given``: how the user gave it) as this plan's model, or None
        when it is the same architecture."""
        differences = self.architecture_differences(other)
        if not differences:
            return None
        shown = "; ".join(differences[:4]) + ("; ..." if len(differences) > 4 else "")
        return (f"{given} is not the plan's model {self.name} ({shown}): give the config.json the plan was made "
                "from, or re-plan with --model on this one")

    @property
    def q_size(self) -> int:
        """Width of the query projection output (heads x head_dim); may differ from hidden."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one of the K or V projections (kv_heads x head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.params(h, self.num_heads)
        weights = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        biases = (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.attn_out_bias
        return weights + biases + 2 * self.head_dim * self.qk_norm

    def mlp_params_per_layer(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.activation == "swiglu":
            return 3 * h * f + (2 * f + h) * self.mlp_bias
        return 2 * h * f + (f + h) * self.mlp_bias

    def norm_params(self) -> int:
        """Parameters of one hidden-size norm (LayerNorm has a bias, RMSNorm does not)."""
        return self.hidden_size * (2 if self.norm == "layernorm" else 1)

    @property
    def norms_per_layer(self) -> int:
        """Hidden-size norms in one layer: the two pre-norms plus any post-norms."""
        return 2 + self.extra_norms_per_layer

    def params_per_layer(self) -> int:
        """Parameters of one dense layer (a MoE model's dense layers; see :meth:`layer_params_total`)."""
        return (self.attention_params_per_layer() + self.mlp_params_per_layer()
                + self.norms_per_layer * self.norm_params())

    @property
    def moe_layer_count(self) -> int:
        """Layers whose FFN is a mixture of experts (0 for a dense model)."""
        return 0 if self.moe is None else self.moe.moe_layer_count(self.num_layers)

    def layer_params_total(self, active: bool = False) -> int:
        """Parameters of all transformer layers together (``active``: those one token multiplies by)."""
        if self.moe is None:
            return self.num_layers * self.params_per_layer()
        sparse = self.moe_layer_count
        ffn = self.moe.active_layer_params(self.hidden_size) if active else self.moe.layer_params(self.hidden_size)
        return (self.num_layers - sparse) * self.params_per_layer() + sparse * (
            self.attention_params_per_layer() + ffn + self.norms_per_layer * self.norm_params())

    def embedding_params(self) -> int:
        """Token embedding plus learned positions (the output head is counted separately)."""
        positions = self.max_position_embeddings * self.hidden_size if self.position_embedding == "learned" else 0
        return self.vocab_size * self.hidden_size + positions

    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total trainable parameters, derived from the architecture."""
        return (
            self.layer_params_total()
            + self.embedding_params()
            + self.lm_head_params()
            + self.norm_params()  # final norm
        )

    @property
    def active_params(self) -> int:
        """Parameters one token uses: ``num_params`` less the experts it is not routed to (embedding and
        head included, the Mixtral/Qwen convention; DeepSeek's 36.6B also leaves out the input embedding)."""
        return self.num_params - self.layer_params_total() + self.layer_params_total(active=True)

    # ----- attention span -------------------------------------------------------------------------
    @property
    def windowed_layers(self) -> int:
        """Layers that attend within :attr:`sliding_window` (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return self.num_layers if self.sliding_window_layers is None else self.sliding_window_layers

    def attention_layer_groups(self, seq_len: int) -> tuple[tuple[int | None, int], ...]:
        """``(window, layers)`` groups for a sequence of ``seq_len`` tokens; window ``None`` is full causal
        attention. A window that is not shorter than the sequence changes nothing, so it is full attention
        (and the model's costs equal those of the same model without a window)."""
        local = self.windowed_layers
        if local == 0 or self.sliding_window is None or self.sliding_window >= seq_len:
            return ((None, self.num_layers),)
        full = self.num_layers - local
        return ((None, full), (self.sliding_window, local)) if full else ((self.sliding_window, local),)

    # ----- divisibility helpers used by Layout checks and the planner --------------------------
    def valid_head_split_degrees(self) -> list[int]:
        """Degrees (TP x Ulysses) that divide the query heads."""
        return [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]

    def kv_replication(self, head_split: int) -> int:
        """How many ranks hold a copy of each KV head when heads are split ``head_split`` ways.

        1 when the KV heads divide evenly; ``head_split / kv_heads`` when there are fewer KV heads
        than ranks (each KV head is replicated); an error when neither divides.
        """
        if self.num_kv_heads % head_split == 0:
            return 1
        if head_split % self.num_kv_heads == 0:
            return head_split // self.num_kv_heads
        raise CostModelError(
            f"a head split of {head_split} does not fit {self.num_kv_heads} KV heads: it must divide them "
            f"or be a multiple of them (for KV replication); choose tp x ulysses among "
            f"{', '.join(map(str, self.valid_head_split_degrees()))}"
        )


# ----- presets ---------------------------------------------------------------------------------


def model_preset_names() -> list[str]:
    """Shipped model presets (``cost_models/data/models/<name>.yaml``), sorted."""
    return list(data.names("models"))


def get_model_preset(name: str) -> ModelSpec:
    """A shipped preset by name or alias (case-insensitive); an unknown name gets the closest ones."""
    key = data.canonical("models", name)
    if key is None:
        raise data.unknown_name("models", name)
    fields = {k: v for k, v in data.load("models", key).items() if k != "aliases"}
    try:
        return ModelSpec(name=key, **fields)
    except ValidationError as exc:  # a broken preset is our bug, but say which one
        raise explain_validation_error(exc, f"model preset {key}") from exc


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name, or a path to a HF ``config.json`` (or a folder containing one): which one is
    :func:`sp_plan.cost_models.data.resolve`'s rule."""
    found = data.resolve("models", name_or_path)
    if found.path is not None:
        return load_hf_config(found.path)
    return get_model_preset(found.name)


# ----- Hugging Face config.json (parsed by :mod:`.hf_config`; built and validated here) -------------------


def load_hf_config(path: Path) -> ModelSpec:
    """Read a local Hugging Face ``config.json`` (a family in :data:`.hf_config.HF_FAMILIES`) without network
    access."""
    if path.is_dir():
        path = path / "config.json"
    config = parse_config_text(data.read_user_text("models", path), str(path))
    return model_from_hf_dict(config, name=path.parent.name or path.stem)


def _bounds(spec_field: str) -> tuple[int, int]:
    """The (lowest, highest) value ModelSpec accepts for an integer field."""
    lo, hi = 1, None
    for meta in getattr(ModelSpec.model_fields[spec_field], "metadata", ()):
        lo = getattr(meta, "ge", None) or lo
        hi = getattr(meta, "le", None) or hi
    return int(lo), int(hi if hi is not None else 1 << 62)


def check_hf_sizes(config: dict, name: str = "hf-model") -> None:
    """Refuse a config.json whose given size fields are out of the spec's bounds, before a library (a
    transformers config class) expands them; see :func:`.hf_config.check_sizes_before_parsing`."""
    check_sizes_before_parsing(config, name, _bounds)


def model_from_hf_dict(config: dict, name: str = "hf-model") -> ModelSpec:
    """A ModelSpec from a parsed HF config, every size checked (positive, finite, bounded, heads consistent)."""
    fields = spec_fields(config, name, _bounds)
    try:
        return ModelSpec(**fields)
    except ValidationError as exc:
        raise explain_validation_error(exc, f"model config {name}") from exc
