"""Hugging Face transformers models (Llama, Qwen2, Qwen3, Mistral) on the sequence-parallel runtime.

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

Create models with random weights from a config, no download::

    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=4, ...))
    setup = sp_plan.runtime.auto_configure(model, seq_len=4096)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sp_plan.cost_models.model_spec import ModelSpec, model_from_hf_dict
from sp_plan.runtime.errors import RuntimeConfigError

#: The attention implementation name registered with transformers.
ATTENTION_NAME = "sp_plan"
#: Attribute of each HF attention module holding its SequenceParallel context.
CONTEXT_ATTRIBUTE = "_sp_plan_context"
#: Decoder-layer containers of the supported families (``model.model.layers``).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeConfigError(
            f"HF models need transformers ({exc.name} is missing): pip install 'sp-plan[hf]'"
        ) from None
    return transformers


def hf_model_spec(model: nn.Module) -> ModelSpec:
    """The ModelSpec of an HF causal LM (from its config; the name is its model_type and size)."""
    config = model.config.to_dict()
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise RuntimeConfigError(
            f"HF model_type {model_type!r} is not supported by the runtime: use one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    name = f"{model_type}-{config.get('num_hidden_layers')}l-{config.get('hidden_size')}h"
    return model_from_hf_dict(config, name=name)


def hf_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``model.model.layers`` for the supported families)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeConfigError(
            f"{type(model).__name__} has no model.layers: pass a *ForCausalLM of a supported family "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return list(layers)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    modules = [getattr(layer, "self_attn", None) for layer in hf_decoder_layers(model)]
    if any(m is None for m in modules):
        raise RuntimeConfigError(f"{type(model).__name__}: a decoder layer has no self_attn module")
    return modules


# ----- attention ------------------------------------------------------------------------------------------


def sequence_parallel_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: SP attention on this rank's shards, no mask."""
    sp = getattr(module, CONTEXT_ATTRIBUTE, None)
    if sp is None:
        raise RuntimeConfigError(
            f"attn_implementation={ATTENTION_NAME!r} on a module without a sequence-parallel context: configure the "
            "model with sp_plan.runtime.auto_configure (or sp_plan.runtime.hf.use_sequence_parallel_attention)"
        )
    if attention_mask is not None:
        raise RuntimeConfigError(
            f"a {tuple(attention_mask.shape)} attention mask reached sequence-parallel attention; the runtime never "
            "uses masks (position_ids carry the layout, padding becomes ignored labels): do not pass attention_mask"
        )
    if dropout:
        raise RuntimeConfigError(f"attention dropout {dropout} is not supported: set config.attention_dropout = 0")
    for unsupported in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise RuntimeConfigError(
                f"{unsupported}={kwargs[unsupported]!r} is not supported by the runtime's attention kernels"
            )
    causal = module.is_causal if is_causal is None else is_causal
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (b, h, s, d) -> (b, s, h, d)
    return sp.attention(q, k, v, causal=causal, scale=scaling, cu_seqlens=kwargs.get("cu_seqlens")), None


def register_attention() -> None:
    """Register :data:`ATTENTION_NAME` in transformers' attention registry (idempotent)."""
    transformers = _transformers()
    transformers.AttentionInterface.register(ATTENTION_NAME, sequence_parallel_attention_forward)


def use_sequence_parallel_attention(model: nn.Module, sp, seq_len: int) -> None:
    """Route every attention of ``model`` through ``sp`` (a :class:`sp_plan.runtime.context.SequenceParallel`)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < seq_len:
        raise RuntimeConfigError(
            f"{config.model_type}: sliding-window attention ({window} tokens) is not supported by the runtime's "
            f"kernels at seq_len {seq_len}; set config.sliding_window = None (full causal attention)"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise RuntimeConfigError(f"attention_dropout={config.attention_dropout} is not supported: set it to 0")
    register_attention()
    for module in _attention_modules(model):
        object.__setattr__(module, CONTEXT_ATTRIBUTE, sp)  # a plain attribute, not a submodule
        if hasattr(module, "sliding_window"):
            module.sliding_window = None  # checked above: equivalent to full attention at this length
    model.set_attn_implementation(ATTENTION_NAME)
    config.use_cache = False  # training: no KV cache


def _documents(cu_seqlens: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


def hf_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
              cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of the local tokens: global ``position_ids`` for RoPE, no mask, no cache; ``cu_seqlens``
    (packed documents, boundaries over the whole batch) reaches the attention as a keyword."""
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **_documents(cu_seqlens))
    return out.logits


#: Name of the method :func:`add_hidden_states_method` gives an HF causal LM.
HIDDEN_STATES_METHOD = "sp_plan_hidden_states"


def _hidden_states(self: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                        **_documents(cu_seqlens)).last_hidden_state
    tp = getattr(self, "tensor_parallel", None)
    return tp.enter(hidden) if tp is not None else hidden  # the vocab-parallel head's TP region


def add_hidden_states_method(model: nn.Module) -> None:
    """Give ``model`` a ``sp_plan_hidden_states(input_ids, position_ids)`` method: the final-norm output
    the lm_head multiplies, for the tiled loss (the logits never materialise). A method of the root
    module (not a call into ``model.model``) so that FSDP2 can register it as a forward method and
    gather the root's parameters (final norm, lm_head) around it."""
    import types

    if getattr(model, "lm_head", None) is None or getattr(model, "model", None) is None:
        raise RuntimeConfigError(
            f"{type(model).__name__} has no lm_head/model pair: the tiled loss needs a *ForCausalLM of a supported "
            f"family ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    setattr(model, HIDDEN_STATES_METHOD, types.MethodType(_hidden_states, model))


# ----- checkpointing ------------------------------------------------------------------------------------


def set_hf_checkpointing(model: nn.Module, mode: str, offload: Any = None) -> None:
    """Checkpoint every decoder layer with the runtime's ``none``/``selective``/``full`` modes;
    ``offload`` (a :class:`sp_plan.runtime.offload.CheckpointOffload`) keeps each layer's checkpointed input
    (its hidden states) in host memory until backward."""
    from sp_plan.runtime.models.checkpointing import check_mode, run_checkpointed

    check_mode(mode)
    transformers = _transformers()
    layer_type = transformers.modeling_layers.GradientCheckpointingLayer

    def checkpointed(function, *args):
        return run_checkpointed(function, mode, *args, offload=offload)

    for layer in hf_decoder_layers(model):
        if not isinstance(layer, layer_type):
            raise RuntimeConfigError(
                f"{type(layer).__name__} does not support checkpointing (not a GradientCheckpointingLayer)"
            )
        layer._gradient_checkpointing_func = checkpointed
        layer.gradient_checkpointing = mode != "none"


# ----- tiled MLP -----------------------------------------------------------------------------------------

#: Set on an HF MLP module whose forward runs tiled (so applying twice is harmless).
TILED_ATTRIBUTE = "_sp_plan_tiled"


def apply_hf_tiled_mlp(model: nn.Module, tile_tokens: int | None = None) -> int:
    """Run every decoder layer's MLP of an HF model over sequence tiles (:mod:`sp_plan.runtime.tiled_mlp`).

    The supported families' MLPs are ``down(act(gate(x)) * up(x))``, row-wise, over HF's own
    ``gate_proj``/``up_proj``/``down_proj``/``act_fn``: the forward is replaced by
    :func:`sp_plan.runtime.tiled_mlp.tiled_gated_mlp` on those modules (the runtime Llama's tiled path, row-parallel
    ``down_proj`` under TP included), and the parameters get their gradients through the tiled op
    (FSDP2's gathered parameters during forward). Tile size: the memory model's rule
    (:func:`sp_plan.runtime.tiled_mlp.tile_tokens_for` with the model's hidden size). Returns the number of MLPs tiled.
    """
    from sp_plan.runtime.tiled_mlp import tile_tokens_for, tiled_gated_mlp

    hidden = model.config.hidden_size
    layers = hf_decoder_layers(model)
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise RuntimeConfigError(f"{type(layer).__name__} has no mlp to tile")
        if getattr(mlp, TILED_ATTRIBUTE, False):
            continue

        def forward(x: torch.Tensor, _mlp: nn.Module = mlp) -> torch.Tensor:
            tile = tile_tokens_for(hidden, x.numel() // x.shape[-1], tile_tokens)
            # Modules looked up at call time: TP may swap in row-parallel shards after tiling is applied.
            return tiled_gated_mlp(x, _mlp.gate_proj, _mlp.up_proj, _mlp.down_proj, _mlp.act_fn, tile)

        mlp.forward = forward
        setattr(mlp, TILED_ATTRIBUTE, True)
    return len(layers)


# ----- tensor parallelism --------------------------------------------------------------------------------


def apply_hf_tensor_parallel(model: nn.Module, mesh_or_group, *, sequence_parallel: bool = True):
    """Megatron tensor parallelism (with sequence parallelism) on an HF Llama/Qwen2/Qwen3/Mistral model,
    in place, with the runtime's own sharding (:mod:`sp_plan.runtime.tp`): the families name their projections
    like the runtime's Llama, so :func:`sp_plan.runtime.tp.shard_block` swaps in the column/row-parallel shards
    and :func:`sp_plan.runtime.tp.shard_vocabulary` the vocab-parallel embedding and lm_head. HF's code is not
    changed: forward pre-hooks open each TP region (all-gather along the sequence before the attention
    and the MLP, and before the lm_head), the row-parallel projections close it. Attention reshapes with
    ``-1`` heads, so it runs on the local heads. Call before FSDP2, like
    :func:`sp_plan.runtime.tp.apply_tensor_parallel`; returns the state, also ``model.tensor_parallel``.
    """
    from sp_plan.runtime.tp import shard_block, shard_vocabulary, tensor_parallel_state

    spec = hf_model_spec(model)
    tp, split = tensor_parallel_state(spec, mesh_or_group, sequence_parallel)
    if tp.size == 1:
        return tp
    object.__setattr__(model, "tensor_parallel", tp)  # state, not a submodule
    for layer in hf_decoder_layers(model):
        shard_block(tp, split, spec, layer.self_attn, layer.mlp, [layer.input_layernorm, layer.post_attention_layernorm])
        layer.self_attn.register_forward_pre_hook(_enter_hidden_states(tp), with_kwargs=True)
        layer.mlp.register_forward_pre_hook(_enter_first_argument(tp))
    inner = model.model
    if tp.sequence_parallel:
        tp.replicated += [(inner.norm, name) for name, _ in inner.norm.named_parameters()]
    tied = spec.tied_embeddings
    inner.embed_tokens, model.lm_head = shard_vocabulary(
        tp, inner.embed_tokens.weight, None if tied else model.lm_head.weight)
    model.lm_head.register_forward_pre_hook(_enter_first_argument(tp))
    return tp


def _enter_first_argument(tp):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (tp.enter(args[0]), *args[1:])

    return hook


def _enter_hidden_states(tp):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (tp.enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": tp.enter(kwargs["hidden_states"])}

    return hook


# ----- building a model from a ModelSpec ----------------------------------------------------------------


def hf_model_from_spec(spec: ModelSpec, max_positions: int = 2048) -> nn.Module:
    """A transformers causal LM with ``spec``'s architecture and random weights (no download, fp32):
    Qwen3 when the spec has q/k norms, Qwen2 when it has QKV biases, else Llama. For checks and examples
    that need an HF model of a planned shape (``sp-plan validate --hf``, the training example)."""
    transformers = _transformers()
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
