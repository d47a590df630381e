"""Hugging Face transformers causal LMs on the sequence-parallel runtime (the ``hf`` model family).

:mod:`.model` (structure, spec, forward, construction), :mod:`.attention` (transformers' attention
registry), :mod:`.techniques` (checkpointing, tiled MLP), :mod:`.tp_plan` (tensor parallelism from a
per-``model_type`` table) and :mod:`.adapter` (what the runtime calls). Submodules are imported on
first use, so that the adapter can be named without torch or transformers.
"""
