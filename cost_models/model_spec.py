"""Transformer architecture description: presets, HF ``config.json`` loading, parameter counts.

Parameter counts are derived from the architecture, never typed in: the planner's memory figures are
only as good as this count, and the tests check it against each model's published total.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, ValidationError, model_serializer, model_validator

from . import data
from .errors import CostModelError, explain_validation_error
from .moe import MLASpec, MoESpec, hf_moe_fields

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
        return self

    # ----- derived sizes -------------------------------------------------------------------
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

    def params_per_layer(self) -> int:
        """Parameters of one dense layer (a MoE model's dense layers; see :meth:`layer_params_total`)."""
        return self.attention_params_per_layer() + self.mlp_params_per_layer() + 2 * self.norm_params()

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
            self.attention_params_per_layer() + ffn + 2 * self.norm_params())

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


# ----- Hugging Face config.json ------------------------------------------------------------------

#: model_type -> (qkv bias default, has q/k norm). Llama exposes ``attention_bias``; Qwen2 always
#: has QKV biases; Qwen3 has per-head q/k RMSNorm and an ``attention_bias`` flag.
_HF_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    # mixture-of-experts / MLA families: their expert and latent fields are read by moe.hf_moe_fields
    "qwen3_moe": (False, True),
    "mixtral": (False, False),
    "deepseek_v2": (False, False),
    "deepseek_v3": (False, False),
}


#: Deepest JSON nesting a config.json may have (real ones nest two or three levels: rope_scaling,
#: quantization_config). Checked before parsing: Python's json recurses and a hostile file of nested
#: brackets would otherwise end in a RecursionError.
_MAX_CONFIG_DEPTH = 32


def _json_depth_ok(text: str, limit: int = _MAX_CONFIG_DEPTH) -> bool:
    """True when no bracket nesting in ``text`` goes deeper than ``limit`` (brackets inside strings are
    counted too: an over-estimate that only a config with 32 nested brackets in its strings could hit)."""
    depth = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def load_hf_config(path: Path) -> ModelSpec:
    """Read a local Hugging Face ``config.json`` (Llama/Mistral/Qwen2/Qwen3) without network access."""
    if path.is_dir():
        path = path / "config.json"
    text = data.read_user_text("models", path)
    if not _json_depth_ok(text):
        raise CostModelError(f"{path} nests deeper than {_MAX_CONFIG_DEPTH} levels, which no model config.json does")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # belt and braces: the depth check above should have caught it
        raise CostModelError(f"{path} nests too deeply to be a model config.json") from exc
    if not isinstance(config, dict):
        raise CostModelError(f"{path} must hold a JSON object")
    return model_from_hf_dict(config, name=path.parent.name or path.stem)


#: config.json size fields -> the ModelSpec bound they must respect (the same limits, named for the user).
_HF_SIZE_FIELDS = {
    "num_hidden_layers": ModelSpec.model_fields["num_layers"],
    "hidden_size": ModelSpec.model_fields["hidden_size"],
    "num_attention_heads": ModelSpec.model_fields["num_heads"],
    "num_key_value_heads": ModelSpec.model_fields["num_kv_heads"],
    "head_dim": ModelSpec.model_fields["head_dim"],
    "intermediate_size": ModelSpec.model_fields["ffn_hidden_size"],
    "vocab_size": ModelSpec.model_fields["vocab_size"],
}


def _bounds(field: object) -> tuple[int, int]:
    lo, hi = 1, None
    for meta in getattr(field, "metadata", ()):
        lo = getattr(meta, "ge", None) or lo
        hi = getattr(meta, "le", None) or hi
    return int(lo), int(hi if hi is not None else 1 << 62)


def _size(config: dict, key: str, name: str, default: int | None = None) -> int:
    """A config.json size field as a positive int within the model's bounds, or one clear error.

    JSON (as Python reads it) allows Infinity, NaN, 1e400, booleans, strings and fractions where a size is
    expected; int() would raise OverflowError on some, truncate others and a zero would reach a division.
    """
    value = config.get(key)
    if value is None:
        if default is not None:
            return default
        raise CostModelError(f"{name}: config.json lacks required field {key!r}")
    lo, hi = _bounds(_HF_SIZE_FIELDS[key])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"{name}: config.json field {key!r} must be a whole number, not {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise CostModelError(f"{name}: config.json field {key!r} must be a finite whole number, not {value!r}")
    number = int(value)
    if not lo <= number <= hi:
        raise CostModelError(f"{name}: config.json field {key!r} is {number}; it must be between {lo} and {hi:,}")
    return number


def model_from_hf_dict(config: dict, name: str = "hf-model") -> ModelSpec:
    """A ModelSpec from a parsed HF config, every size checked (positive, finite, bounded, heads consistent)."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in _HF_FAMILIES:
        raise CostModelError(
            f"model_type {model_type!r} is not supported: supported families are {', '.join(sorted(_HF_FAMILIES))}"
        )
    qkv_bias_default, qk_norm = _HF_FAMILIES[model_type]
    heads = _size(config, "num_attention_heads", name)
    hidden = _size(config, "hidden_size", name)
    kv_heads = _size(config, "num_key_value_heads", name, default=heads)
    if config.get("head_dim") is None and hidden % heads:
        raise CostModelError(
            f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and config.json gives "
            "no head_dim; add head_dim or fix the head count")
    if heads % kv_heads:
        raise CostModelError(
            f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} (each KV head "
            "serves a whole number of query heads); fix one of them")
    fields = dict(
        name=name,
        num_layers=_size(config, "num_hidden_layers", name),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_size(config, "head_dim", name, default=hidden // heads or 1),
        ffn_hidden_size=_size(config, "intermediate_size", name),
        vocab_size=_size(config, "vocab_size", name),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        activation="swiglu",
        norm="rmsnorm",
        qkv_bias=bool(config.get("attention_bias", qkv_bias_default)),
        attn_out_bias=bool(config.get("attention_bias", False)) and model_type == "llama",
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=qk_norm,
    )
    fields.update(hf_moe_fields(config, model_type, name, fields["num_layers"]))  # experts, MLA (moe.py)
    try:
        return ModelSpec(**fields)
    except ValidationError as exc:
        raise explain_validation_error(exc, f"model config {name}") from exc
