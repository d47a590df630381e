"""Hugging Face transformers models (Llama, Qwen2, Qwen3, Mistral; MoE: Qwen3-MoE, Mixtral; MLA + MoE: DeepSeek-V2
and V3) on the SP runtime.

Optional: ``transformers`` is imported lazily (``pip install 'sp-plan[hf]'``). Pieces:

- :func:`hf_model_spec`: the cost models' ModelSpec of a model, via
  :func:`sp_plan.cost_models.model_spec.model_from_hf_dict` on its config (for planning);
- attention: :data:`ATTENTION_NAME` is registered in transformers' ``AttentionInterface`` and set as the
  model's ``attn_implementation``. Each attention module carries its
  :class:`sp_plan.runtime.context.SequenceParallel` context; the registered function transposes HF's
  ``(batch, heads, seq, head_dim)`` to the runtime's ``(batch, seq, heads, head_dim)``, runs the
  planned Ulysses / Ring / USP attention on the local shards (GQA handled natively, KV heads never
  repeated by HF) and returns ``(batch, seq, heads, head_dim)`` as HF's own kernels do;
- masks: the name is deliberately NOT registered in ``AttentionMaskInterface``, so transformers builds
  no mask for it; the attention function refuses any mask it is given. Positions come from the
  ``position_ids`` the sharder produced (global positions of the local tokens, RoPE only). Packed
  documents: the sharder's ``cu_seqlens`` (boundaries over the whole batch) is passed as the model
  keyword ``cu_seqlens``, which transformers forwards through each layer to the attention function
  (its ``**kwargs``), and attention is document-masked (:mod:`sp_plan.runtime.attention.documents`);
- checkpointing: each decoder layer (a ``GradientCheckpointingLayer``) checkpoints its ``forward``
  through :func:`sp_plan.runtime.models.checkpointing.run_checkpointed`, so ``none``/``selective``/``full``
  mean exactly what they mean for the runtime's own Llama (FSDP2's hooks stay outside the checkpoint);
- the tiled MLP (:func:`apply_hf_tiled_mlp`) and tensor parallelism (:func:`apply_hf_tensor_parallel`)
  reuse the runtime's pieces on HF's own modules (no copy of HF's code).

This package splits those pieces by job: :mod:`.model` (this module: the model's structure, spec,
forward and construction), :mod:`.attention`, :mod:`.techniques` (checkpointing, tiled MLP),
:mod:`.tp_plan` (tensor parallelism from a per-``model_type`` table) and :mod:`.adapter`, which hands
them to the runtime.

Create models with random weights from a config, no download::

    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=4, ...))
    setup = sp_plan.runtime.auto_configure(model, seq_len=4096)
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn

from sp_plan.cost_models import data
from sp_plan.cost_models.hf_config import config_object_dict, parse_config_text
from sp_plan.cost_models.model_spec import ModelSpec, check_hf_sizes, model_from_hf_dict
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.models.hf.architectures import HF_ARCHITECTURES, HFArchitecture
from sp_plan.runtime.models.hf.names import HIDDEN_STATES_METHOD

#: The HF ``model_type``s the runtime drives: those with an :data:`HF_ARCHITECTURES` entry.
SUPPORTED_MODEL_TYPES = tuple(HF_ARCHITECTURES)


def transformers_module():
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeConfigError(
            f"HF models need transformers ({exc.name} is missing): pip install 'sp-plan[hf]'"
        ) from None
    return transformers


def hf_architecture(model: nn.Module) -> HFArchitecture:
    """Where ``model``'s family keeps its modules (its ``config.model_type``'s table entry)."""
    model_type = str(getattr(model.config, "model_type", "")).lower()
    try:
        return HF_ARCHITECTURES[model_type]
    except KeyError:
        raise RuntimeConfigError(
            f"HF model_type {model_type!r} is not supported by the runtime: use one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (a new family with the usual decoder layer is one entry in "
            "sp_plan.runtime.models.hf.architectures.HF_ARCHITECTURES)"
        ) from None


def module_at(root: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` (None when a step is missing)."""
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


#: The name the runtime used before the dict moved to the cost models (a torch-free home the CLI shares).
hf_config_dict = config_object_dict


def hf_model_spec(model: nn.Module) -> ModelSpec:
    """The ModelSpec of an HF causal LM (from its config; the name is its model_type and size)."""
    hf_architecture(model)  # refuses the families the runtime does not drive
    config = config_object_dict(model.config)
    model_type = str(config.get("model_type", "")).lower()
    name = f"{model_type}-{config.get('num_hidden_layers')}l-{config.get('hidden_size')}h"
    return model_from_hf_dict(config, name=name)


def hf_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (at the family's :attr:`HFArchitecture.layers` path, ``model.layers``)."""
    path = hf_architecture(model).layers
    layers = module_at(model, path)
    if layers is None:
        raise RuntimeConfigError(
            f"{type(model).__name__} has no {path}: pass a *ForCausalLM of a supported family "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return list(layers)


def _documents(cu_seqlens: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


def _inputs(tokens_or_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token ids, or (a later model part's input) the previous part's hidden states as ``inputs_embeds``."""
    if tokens_or_hidden.is_floating_point():
        return {"inputs_embeds": tokens_or_hidden}
    return {"input_ids": tokens_or_hidden}


def hf_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
              cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of the local tokens: global ``position_ids`` for RoPE, no mask, no cache; ``cu_seqlens``
    (packed documents, boundaries over the whole batch) reaches the attention as a keyword."""
    out = model(**_inputs(input_ids), position_ids=position_ids, use_cache=False, **_documents(cu_seqlens))
    return out.logits


def _hidden_states(self: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    hidden = self.model(**_inputs(input_ids), position_ids=position_ids, use_cache=False,
                        **_documents(cu_seqlens)).last_hidden_state
    tp = getattr(self, "tensor_parallel", None)
    return tp.enter(hidden) if tp is not None else hidden  # the vocab-parallel head's TP region


def add_hidden_states_method(model: nn.Module) -> None:
    """Give ``model`` a ``sp_plan_hidden_states(input_ids, position_ids)`` method: the final-norm output
    the lm_head multiplies, for the tiled loss (the logits never materialise). A method of the root
    module (not a call into ``model.model``) so that FSDP2 can register it as a forward method and
    gather the root's parameters (final norm, lm_head) around it."""
    if getattr(model, "lm_head", None) is None or getattr(model, "model", None) is None:
        raise RuntimeConfigError(
            f"{type(model).__name__} has no lm_head/model pair: the tiled loss needs a *ForCausalLM of a supported "
            f"family ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    setattr(model, HIDDEN_STATES_METHOD, types.MethodType(_hidden_states, model))


# ----- building a model from a ModelSpec ----------------------------------------------------------------


def hf_model_from_spec(spec: ModelSpec, max_positions: int = 2048) -> nn.Module:
    """A transformers causal LM with ``spec``'s architecture and random weights (no download, fp32):
    Qwen3 when the spec has q/k norms, Qwen2 when it has QKV biases, else Llama. For checks and examples
    that need an HF model of a planned shape (``sp-plan validate --hf``, the training example)."""
    transformers = transformers_module()
    if spec.hidden_dropout or spec.attention_dropout:
        raise RuntimeConfigError(f"{spec.name}: dropout is not supported on the HF path; set it to 0")
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                  max_position_embeddings=max(max_positions, 2048), tie_word_embeddings=spec.tied_embeddings,
                  attention_dropout=0.0)
    if spec.qk_norm:
        config = transformers.Qwen3Config(**common)
    elif spec.qkv_bias:
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
    else:
        config = transformers.LlamaConfig(**common)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def hf_model_from_config_file(path: str | Path) -> nn.Module:
    """The transformers causal LM a local ``config.json`` describes (or a folder holding one), with random
    weights (seeded by the caller), fp32, no download: ``sp-plan train --model`` trains exactly the
    architecture ``sp-plan plan/estimate --model`` plan for (MoE and MLA families included, which a
    ModelSpec alone cannot rebuild). The file is untrusted input: read through the cost models' bounded
    reader, every size checked as a ModelSpec (:func:`model_from_hf_dict`) before transformers sees it,
    and only the families the runtime drives are built."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise RuntimeConfigError(f"--model {str(path)!r}: no such file; give a Hugging Face config.json (or its "
                                 "folder). Presets have no HF config: plan with sp-plan plan --model NAME --out "
                                 "plan.yaml and train with --plan")
    config = parse_config_text(data.read_user_text("models", path), str(path))
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in HF_ARCHITECTURES:
        raise RuntimeConfigError(f"{path}: model_type {model_type!r} is not trained by the runtime; supported: "
                                 f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    name = path.parent.name or path.stem
    check_hf_sizes(config, name)  # every given size bounded before transformers expands it
    transformers = transformers_module()
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - the class refused a value: the cost models' parser names it
        model_from_hf_dict(config, name=name)
        raise RuntimeConfigError(f"{path}: transformers' {model_type} config refused it: {exc}") from exc
    # Checked as the planner reads it: through the class's defaults and attribute aliases (a config.json saved
    # by current transformers names Qwen3-MoE's experts num_local_experts, the family's authors num_experts).
    model_from_hf_dict({**config, **config_object_dict(hf_config)}, name=name)
    return transformers.AutoModelForCausalLM.from_config(hf_config).float()
