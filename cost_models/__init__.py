"""Analytical cost models for long-context training: specs, memory, communication, time.

Pure Python (pydantic, networkx, scipy); never imports torch, so the planner stays light and fast.
"""

from .errors import CostModelError
from .gpu_spec import GPUSpec, get_gpu_preset, gpu_preset_names
from .layout import MESH_DIMS, Layout
from .model_spec import ModelSpec, get_model_preset, load_model, model_preset_names
from .train_spec import TrainSpec
from .units import GB, GiB, parse_seq_len

__all__ = [
    "CostModelError",
    "GB",
    "GPUSpec",
    "GiB",
    "Layout",
    "MESH_DIMS",
    "ModelSpec",
    "TrainSpec",
    "get_gpu_preset",
    "get_model_preset",
    "gpu_preset_names",
    "load_model",
    "model_preset_names",
    "parse_seq_len",
]
