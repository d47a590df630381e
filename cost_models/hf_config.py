"""Hugging Face ``config.json`` -> the fields of a :class:`~sp_plan.cost_models.model_spec.ModelSpec`.

One table, :data:`HF_FAMILIES`, keyed by ``model_type``, says how each family's config maps onto the
spec: which biases it has, q/k norms, extra norms, the defaults its config class fills in when a shipped
``config.json`` omits a field (Gemma's head_dim, tied embeddings, Gemma 3's vocabulary), which
checkpoint tensors are fused (same parameter count as separate ones), where a multimodal wrapper keeps
its decoder (``text_config``) and which layers use a sliding window. A new dense family is one entry.

This module only parses: it reads no file and touches no network (the hub lookup lives in the CLI
layer), and it builds a plain dict of spec fields so that :mod:`.model_spec` (which re-exports
``load_hf_config``/``model_from_hf_dict``) constructs and validates the spec without an import circle.
Every size is checked here (whole, finite, within the spec's bounds): a config.json is untrusted input.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config_fields import whole_number
from .errors import CostModelError
from .json_io import json_loads
from .moe import hf_moe_fields

#: ``bounds(spec_field) -> (lowest, highest)``: the ModelSpec limits, supplied by the caller.
Bounds = Callable[[str], tuple[int, int]]

#: config.json size fields -> the ModelSpec field whose bounds they must respect.
SIZE_FIELDS = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "ffn_hidden_size",
    "vocab_size": "vocab_size",
}

#: ``layer_types`` entries we can price (transformers' names); others (chunked attention) are refused.
FULL, SLIDING = "full_attention", "sliding_attention"


def _every_layer(config: Mapping[str, Any], layers: int, name: str) -> int:
    """Mistral v0.1, Phi-3: the window applies in every layer."""
    return layers


def _above_max_window_layers(config: Mapping[str, Any], layers: int, name: str) -> int:
    """Qwen2/Qwen3 (``use_sliding_window``): layers from ``max_window_layers`` on use the window."""
    first = _whole(config, "max_window_layers", name, 0, 10_000)
    return max(0, layers - first)


def _every_but_each_nth(pattern_key: str | None, pattern_default: int) -> Callable[[Mapping[str, Any], int, str], int]:
    """Gemma 2 (every 2nd layer global) and Gemma 3 (every ``sliding_window_pattern``-th, default 6)."""

    def count(config: Mapping[str, Any], layers: int, name: str) -> int:
        pattern = pattern_default
        if pattern_key is not None:
            pattern = _whole(config, pattern_key, name, 1, 10_000, default=pattern_default)
        return layers - layers // pattern

    return count


@dataclass(frozen=True)
class HFFamily:
    """How one ``model_type``'s config.json maps onto a ModelSpec."""

    #: QKV bias when the config has no ``attention_bias`` (Qwen2 always has one).
    qkv_bias: bool = False
    #: Whether ``attention_bias`` also puts a bias on the output projection (Llama, Qwen3, Gemma).
    out_bias_follows_attention_bias: bool = False
    #: Per-head RMSNorm on queries and keys (Qwen3, Gemma 3).
    qk_norm: bool = False
    #: Hidden-size norms beyond the two pre-norms (Gemma 2/3: post-attention and post-MLP norms).
    extra_norms: int = 0
    #: The config class's defaults for fields shipped config.json files leave out.
    defaults: Mapping[str, Any] = field(default_factory=dict)
    #: Checkpoint tensors that hold several projections (Phi-3's ``qkv_proj``, ``gate_up_proj``). Their
    #: parameter count equals the separate projections'; tensor parallelism must split them by part.
    fused: tuple[str, ...] = ()
    #: A multimodal wrapper whose decoder is described by ``text_config`` of this ``model_type``.
    text_config: str | None = None
    #: Counts the layers using ``sliding_window`` when the config has no ``layer_types``; ``None``:
    #: the family has no sliding window (a stray ``sliding_window`` key is ignored, as HF does).
    window_layers: Callable[[Mapping[str, Any], int, str], int] | None = None
    #: A boolean config key that must be true for the window to apply (Qwen2's ``use_sliding_window``).
    window_switch: str | None = None


_GEMMA_DEFAULTS = {"head_dim": 256, "tie_word_embeddings": True}

#: model_type -> family. GeGLU (Gemma's gate with GELU-tanh) is priced as the spec's gated MLP
#: (``swiglu``: three matrices); attention logit soft-capping (Gemma 2) is an attention-kernel option
#: (FlashAttention-2 ``softcap``) with no parameters and about no time.
HF_FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily(out_bias_follows_attention_bias=True),
    "mistral": HFFamily(defaults={"sliding_window": 4096}, window_layers=_every_layer),  # v0.2+ say null
    "qwen2": HFFamily(qkv_bias=True, defaults={"max_window_layers": 28}, window_layers=_above_max_window_layers,
                      window_switch="use_sliding_window"),
    "qwen3": HFFamily(out_bias_follows_attention_bias=True, qk_norm=True, defaults={"max_window_layers": 28},
                      window_layers=_above_max_window_layers, window_switch="use_sliding_window"),
    "gemma": HFFamily(out_bias_follows_attention_bias=True, defaults=_GEMMA_DEFAULTS),
    "gemma2": HFFamily(out_bias_follows_attention_bias=True, extra_norms=2,
                       defaults={**_GEMMA_DEFAULTS, "sliding_window": 4096},
                       window_layers=_every_but_each_nth(None, 2)),
    "gemma3_text": HFFamily(out_bias_follows_attention_bias=True, qk_norm=True, extra_norms=2,
                            defaults={**_GEMMA_DEFAULTS, "vocab_size": 262_208, "sliding_window": 4096},
                            window_layers=_every_but_each_nth("sliding_window_pattern", 6)),
    "gemma3": HFFamily(text_config="gemma3_text"),
    "phi3": HFFamily(fused=("qkv_proj", "gate_up_proj"), window_layers=_every_layer),
    # mixture-of-experts / MLA families: their expert and latent fields are read by moe.hf_moe_fields
    "qwen3_moe": HFFamily(out_bias_follows_attention_bias=True, qk_norm=True, defaults={"max_window_layers": 28},
                          window_layers=_above_max_window_layers, window_switch="use_sliding_window"),
    "mixtral": HFFamily(window_layers=_every_layer),
    "deepseek_v2": HFFamily(),
    "deepseek_v3": HFFamily(),
}
#: Families whose experts :func:`~sp_plan.cost_models.moe.hf_moe_fields` reads.
MOE_FAMILIES = frozenset({"qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"})

#: Deepest JSON nesting a config.json may have (real ones nest two or three levels: rope_scaling,
#: quantization_config, a wrapper's text_config). Checked before parsing: Python's json recurses and a
#: hostile file of nested brackets would otherwise end in a RecursionError.
MAX_CONFIG_DEPTH = 32


def _json_depth_ok(text: str, limit: int = MAX_CONFIG_DEPTH) -> bool:
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


def parse_config_text(text: str, where: str) -> dict[str, Any]:
    """The JSON object in a config.json's text, or one clear error naming ``where`` it came from."""
    if not _json_depth_ok(text):
        raise CostModelError(f"{where} nests deeper than {MAX_CONFIG_DEPTH} levels, which no model config.json does")
    try:
        config = json_loads(text)
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{where} is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # belt and braces: the depth check above should have caught it
        raise CostModelError(f"{where} nests too deeply to be a model config.json") from exc
    if not isinstance(config, dict):
        raise CostModelError(f"{where} must hold a JSON object")
    return config


#: Count fields beyond :data:`SIZE_FIELDS` that a transformers config class may expand into per-layer or
#: per-expert structures (Gemma 2 and Qwen2 build ``layer_types`` from the layer count), with the widest
#: range any real model needs: ``(lowest, highest)``.
EXPANDED_COUNTS = {
    "max_window_layers": (0, 10_000), "first_k_dense_replace": (0, 10_000), "moe_layer_freq": (1, 10_000),
    "decoder_sparse_step": (1, 10_000), "num_experts": (0, 1 << 16), "num_local_experts": (0, 1 << 16),
    "n_routed_experts": (0, 1 << 16), "n_shared_experts": (0, 1 << 10), "num_experts_per_tok": (0, 1 << 10),
    "moe_intermediate_size": (1, 1 << 22), "kv_lora_rank": (1, 1 << 20), "q_lora_rank": (1, 1 << 20),
    "sliding_window": (1, 1 << 30), "sliding_window_pattern": (1, 10_000), "n_group": (1, 1 << 10),
    "topk_group": (1, 1 << 10),
}


def check_sizes_before_parsing(config: Mapping[str, Any], name: str, bounds: Bounds) -> None:
    """Every size field ``config`` (and a wrapper's ``text_config``) gives, bounded before any library sees
    it: a config class builds lists from the raw layer count (2**31 layers ran for minutes with growing
    memory inside transformers, before :func:`spec_fields` could refuse it). Absent or null fields pass:
    the class fills in its defaults, which are checked with the rest afterwards."""
    for where, part in ((name, config), (f"{name} text_config", config.get("text_config"))):
        if not isinstance(part, Mapping):
            continue
        for key, spec_field in SIZE_FIELDS.items():
            if part.get(key) is not None:
                _whole(part, key, where, *bounds(spec_field))
        for key, (lo, hi) in EXPANDED_COUNTS.items():
            if part.get(key) is not None:
                _whole(part, key, where, lo, hi)


def _whole(config: Mapping[str, Any], key: str, name: str, lo: int, hi: int, default: int | None = None) -> int:
    return whole_number(config, key, name, lo, hi, default)


def family_of(config: Mapping[str, Any], name: str) -> tuple[str, HFFamily, Mapping[str, Any]]:
    """``(model_type, family, decoder config)``: a wrapper's ``text_config`` is the decoder, with the
    family's defaults filled in for the fields the file leaves out (as its config class does)."""
    model_type = str(config.get("model_type", "")).lower()
    if not model_type:  # said as "model_type '' is not supported", which does not tell what to add
        arch = config.get("architectures")
        named = f" (architectures: {', '.join(map(str, arch))[:200]})" if isinstance(arch, list) and arch else ""
        raise CostModelError(f"{name}: config.json has no model_type{named}; add the model_type of its transformers "
                             f"config class, one of {', '.join(sorted(HF_FAMILIES))}")
    if model_type not in HF_FAMILIES:
        raise CostModelError(
            f"model_type {model_type!r} is not supported: supported families are {', '.join(sorted(HF_FAMILIES))}"
        )
    family = HF_FAMILIES[model_type]
    if family.text_config is not None:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CostModelError(f"{name}: a {model_type} config.json must hold its decoder in a 'text_config' object")
        model_type, family = family.text_config, HF_FAMILIES[family.text_config]
        tied = config.get("tie_word_embeddings")  # the wrapper ties the decoder's embeddings
        config = {**text} if tied is None or "tie_word_embeddings" in text else {**text, "tie_word_embeddings": tied}
    # Defaults fill absent keys only: an explicit null (Mistral v0.2's "sliding_window": null) stays.
    return model_type, family, {**family.defaults, **config}


def _windowed_layers(config: Mapping[str, Any], family: HFFamily, layers: int, name: str,
                     bounds: Bounds) -> tuple[int | None, int | None]:
    """``(sliding_window, layers using it)``; ``(None, None)`` without a window. ``layer_types`` (newer
    configs list every layer's kind) wins over the family's rule."""
    if family.window_layers is None or config.get("sliding_window") is None:
        return None, None
    if family.window_switch is not None and config.get(family.window_switch) is not True:
        return None, None
    window = _whole(config, "sliding_window", name, *bounds("sliding_window"))
    kinds = config.get("layer_types")
    if kinds is None:
        count = family.window_layers(config, layers, name)
    else:
        if not isinstance(kinds, list) or len(kinds) != layers:
            raise CostModelError(f"{name}: config.json field 'layer_types' must list one kind per layer ({layers})")
        unknown = sorted({str(k) for k in kinds} - {FULL, SLIDING})
        if unknown:
            raise CostModelError(f"{name}: layer_types {', '.join(unknown)} are not modelled; only {FULL} and "
                                 f"{SLIDING} are")
        count = kinds.count(SLIDING)
    return (window, count) if count else (None, None)


def spec_fields(config: Mapping[str, Any], name: str, bounds: Bounds) -> dict[str, Any]:
    """The ModelSpec fields of a parsed config.json, every size checked (positive, finite, bounded, heads
    consistent)."""
    model_type, family, config = family_of(config, name)
    if (config.get("num_experts") or config.get("num_local_experts")) and model_type not in MOE_FAMILIES:
        raise CostModelError(f"{name}: {model_type} with experts is not modelled; mixture-of-experts families are "
                             f"{', '.join(sorted(MOE_FAMILIES))}")

    def size(key: str, default: int | None = None) -> int:
        return _whole(config, key, name, *bounds(SIZE_FIELDS[key]), default=default)

    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    kv_heads = size("num_key_value_heads", default=heads)
    if config.get("head_dim") is None and hidden % heads:
        raise CostModelError(
            f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and config.json gives "
            "no head_dim; add head_dim or fix the head count")
    if heads % kv_heads:
        raise CostModelError(
            f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} (each KV head "
            "serves a whole number of query heads); fix one of them")
    layers = size("num_hidden_layers")
    window, windowed = _windowed_layers(config, family, layers, name, bounds)
    attention_bias = config.get("attention_bias")
    return dict(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=size("head_dim", default=hidden // heads or 1),
        ffn_hidden_size=size("intermediate_size"),
        vocab_size=size("vocab_size"),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        activation="swiglu",
        norm="rmsnorm",
        qkv_bias=bool(family.qkv_bias if attention_bias is None else attention_bias),
        attn_out_bias=bool(attention_bias) and family.out_bias_follows_attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        extra_norms_per_layer=family.extra_norms,
        sliding_window=window,
        sliding_window_layers=None if windowed is None or windowed == layers else windowed,
    ) | hf_moe_fields(config, model_type, name, layers)  # experts and MLA (cost_models/moe.py)


def config_object_dict(config: Any) -> dict[str, Any]:
    """A transformers ``PretrainedConfig`` as a config.json dict: ``config.to_dict()`` plus the names of its
    ``attribute_map`` aliases. A config.json names a field as the family's authors do (Qwen3-MoE's
    ``num_experts``), while transformers may store it under another name (``num_local_experts``) and write
    only that one; the table above reads either. Duck-typed: nothing here imports transformers."""
    out = config.to_dict()
    for alias, attribute in getattr(config, "attribute_map", {}).items():
        if alias not in out and hasattr(config, attribute):
            out[alias] = getattr(config, attribute)
    return out


__all__ = ["EXPANDED_COUNTS", "HF_FAMILIES", "MAX_CONFIG_DEPTH", "HFFamily", "check_sizes_before_parsing",
           "config_object_dict", "parse_config_text", "spec_fields"]
