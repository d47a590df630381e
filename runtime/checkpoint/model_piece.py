"""The model piece: every model part's parameters and persistent buffers, and the plan they were trained with.

Tensors are keyed ``model::<fqn>`` (the unparallelised model's names and shapes, whatever the layout);
``trainer_state.json`` gets the plan's model, training options and layout (compared on load) and the
whole plan (a resumed run on the same number of ranks may reuse it:
``sp_plan.planner.plan.plan_from_dict(state["plan"])``). Loading refuses a checkpoint of another
architecture before any tensor is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sp_plan.runtime.checkpoint.files import SEP, key
from sp_plan.runtime.checkpoint.geometry import Chunk, Geometry, geometry_of, model_parts, model_state
from sp_plan.runtime.checkpoint.piece import Loading, Piece
from sp_plan.runtime.errors import RuntimeConfigError

#: Tensor key prefixes: the model's weights, the optimizer's states, a host-offload optimizer's fp32 masters.
MODEL, OPTIM, MASTER = "model", "optim", "master"
#: Architecture fields a checkpoint's model must share with the model it is loaded into.
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
    "tied_embeddings", "activation", "norm", "position_embedding", "qkv_bias", "attn_out_bias", "mlp_bias",
    "qk_norm",
)


def plan_json(plan: Any) -> dict[str, Any]:
    """The plan's model, training options and layout (compared on load), and the whole plan."""
    return {"model": plan.model.model_dump(mode="json"), "train": plan.train.model_dump(mode="json"),
            "layout": plan.layout.model_dump(mode="json"), "plan": plan.model_dump(mode="json")}


def check_same_model(saved: Mapping[str, Any], spec: Any, path: Path) -> None:
    """Refuse a checkpoint of another architecture, naming the first differing fields."""
    differ = [f"{name}: checkpoint {saved.get(name)!r} vs model {getattr(spec, name)!r}"
              for name in ARCHITECTURE_FIELDS if saved.get(name) != getattr(spec, name)]
    if differ:
        raise RuntimeConfigError(
            f"checkpoint {path} was saved for {saved.get('name', 'another model')}, not this model "
            f"({'; '.join(differ[:3])}): resume with the same architecture, or start a new checkpoint directory"
        )


class ModelPiece(Piece):
    """``setup``'s model parts (``setup.model_parts``, else ``[setup.model]``) under its tensor parallelism,
    and its plan. :attr:`geometry` (where this rank's piece of each entry lies) is computed by
    :meth:`begin`, collectively under TP, and shared with the optimizer piece."""

    name = "model"

    def __init__(self, setup: Any) -> None:
        self.parts = model_parts(setup)
        self.tensor_parallel = getattr(setup, "tensor_parallel", None)
        self.plan = setup.plan
        self._geometry: dict[str, Geometry] | None = None

    @property
    def geometry(self) -> dict[str, Geometry]:
        if self._geometry is None:
            raise RuntimeError("ModelPiece.geometry is computed by begin(), which the checkpoint manager calls")
        return self._geometry

    def begin(self) -> None:
        self._geometry = geometry_of(self.parts, self.tensor_parallel)

    def save_chunks(self) -> dict[str, Chunk]:
        return {key(MODEL, n): self.geometry[n].chunk(t, n) for n, t in model_state(self.parts).items()}

    def save_json(self) -> dict[str, Any]:
        return plan_json(self.plan)

    def load_json(self, loading: Loading) -> None:
        check_same_model(loading.state.get("model") or {}, self.plan.model, loading.path)

    def load_targets(self, loading: Loading) -> dict[str, Chunk]:
        saved = loading.saved_tensors
        has_masters = any(k.startswith(MASTER + SEP) for k in saved)
        targets = {}
        for name, t in model_state(self.parts).items():
            source = key(MODEL, name)
            # fp32 weights of a host-offload run live in its masters (its device copies may be bf16)
            if has_masters and key(MASTER, name) in saved and t.dtype == torch.float32:
                source = key(MASTER, name)
            targets[key(MODEL, name)] = self.geometry[name].chunk(t, name, source)
        return targets
