"""Hugging Face transformers causal LMs on the sequence-parallel runtime (the ``hf`` model family).

:mod:`.architectures` (the per-``model_type`` table of module names: a new family is one entry),
:mod:`.model` (structure, spec, forward, construction), :mod:`.attention` (transformers' attention
registry), :mod:`.techniques` (checkpointing, tiled MLP), :mod:`.tp_plan` (tensor parallelism from the
table), :mod:`.moe` (the mixture-of-experts settings refused) and :mod:`.adapter` (what the runtime calls). Submodules are imported on
first use, so that the adapter can be named without torch or transformers.
"""
