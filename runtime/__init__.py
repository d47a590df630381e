"""Runtime: turns a plan into process groups, sequence-parallel attention and a training setup.

Needs torch (the ``[runtime]`` extra). Heavy optional pieces (flash-attn, transformers) are imported
lazily where used.
"""
