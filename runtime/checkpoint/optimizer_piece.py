"""The optimizer piece: optimizer states (and a host-offload optimizer's fp32 masters) by parameter name.

Tensors are keyed ``optim::<fqn>::<state>`` (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) and
``master::<fqn>`` (:class:`sp_plan.runtime.host_optimizer.HostOffloadOptimizer`'s fp32 host masters), each
state at its parameter's offsets in the full tensor (states must have the parameter's shape, or be
scalars); ``trainer_state.json`` gets the class and the parameter groups' hyperparameters. A checkpoint of
a host-offload run loads into a plain optimizer and back: the model's weights seed the masters when a
checkpoint has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sp_plan.runtime.checkpoint.files import SEP, key
from sp_plan.runtime.checkpoint.geometry import Chunk, local_tensor, parameter_names
from sp_plan.runtime.checkpoint.model_piece import MASTER, MODEL, OPTIM, ModelPiece
from sp_plan.runtime.checkpoint.piece import Loading, Piece
from sp_plan.runtime.errors import RuntimeConfigError
from sp_plan.runtime.host_optimizer import HostOffloadOptimizer


def _name_of(names: dict[int, str], p: torch.Tensor) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise RuntimeConfigError(
            "the optimizer steps a tensor that is not a parameter of setup.model: build it after auto_configure "
            "on setup.model.parameters() (setup.make_optimizer does)"
        ) from None


def optimizer_params(optimizer, parts) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(optimizer's parameter object, its model name, the model parameter) for every parameter it steps."""
    names = parameter_names(parts)
    if isinstance(optimizer, HostOffloadOptimizer):
        return [(master, _name_of(names, p), p) for master, p in zip(optimizer.masters, optimizer.device_params)]
    return [(p, _name_of(names, p), p) for group in optimizer.param_groups for p in group["params"]]


def param_groups_json(optimizer) -> list[dict[str, Any]]:
    """The parameter groups' hyperparameters as JSON (tensors as numbers, tuples as lists)."""
    groups = []
    for group in optimizer.param_groups:
        entry = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v.tolist()
            entry[k] = list(v) if isinstance(v, tuple) else v
        groups.append(entry)
    return groups


class OptimizerPiece(Piece):
    """``optimizer`` (None: a checkpoint without optimizer state) over the parameters of ``model``'s parts,
    sharing the model piece's geometry (register it after the model piece)."""

    name = "optimizer"

    def __init__(self, optimizer, model: ModelPiece) -> None:
        self.optimizer, self.model = optimizer, model
        self.host = isinstance(optimizer, HostOffloadOptimizer)
        self._new_state: dict = {}

    def save_chunks(self) -> dict[str, Chunk]:
        if self.optimizer is None:
            return {}
        entries: dict[str, Chunk] = {}
        for opt_param, name, _ in optimizer_params(self.optimizer, self.model.parts):
            g = self.model.geometry[name]
            for state_name, value in self.optimizer.state.get(opt_param, {}).items():
                k = key(OPTIM, name, state_name)
                if not isinstance(value, torch.Tensor):
                    raise RuntimeConfigError(
                        f"optimizer state {state_name!r} of {name} is a {type(value).__name__}, not a tensor: "
                        "only tensor optimizer states are checkpointed"
                    )
                entries[k] = Chunk(value, (), ()) if value.dim() == 0 else g.chunk(value, f"optimizer state {k}")
            if self.host:
                entries[key(MASTER, name)] = g.chunk(opt_param, f"host master of {name}")
        return entries

    def save_json(self) -> dict[str, Any]:
        optimizer = self.optimizer
        return {"optimizer": None if optimizer is None else {
            "class": type(getattr(optimizer, "inner", optimizer)).__name__,
            "host_offload": self.host, "param_groups": param_groups_json(optimizer)}}

    def load_json(self, loading: Loading) -> None:
        if self.optimizer is not None and loading.state.get("optimizer") is None:
            raise RuntimeConfigError(f"checkpoint {loading.path} has no optimizer state: load it with optimizer=None")

    def load_targets(self, loading: Loading) -> dict[str, Chunk]:
        """Zeroed states to read into (installed by :meth:`load_finish`), and the masters themselves."""
        self._new_state = {}
        if self.optimizer is None:
            return {}
        saved, path = loading.saved_tensors, loading.path
        has_masters = any(k.startswith(MASTER + SEP) for k in saved)
        on_device = any(group.get("capturable") or group.get("fused") for group in self.optimizer.param_groups)
        targets: dict[str, Chunk] = {}
        for opt_param, name, _ in optimizer_params(self.optimizer, self.model.parts):
            g = self.model.geometry[name]
            prefix = key(OPTIM, name) + SEP
            names = [k[len(prefix):] for k in saved if k.startswith(prefix)]
            if not names and any(k.startswith(OPTIM + SEP) for k in saved):
                raise RuntimeConfigError(f"checkpoint {path} has no optimizer state for parameter {name}")
            state = {}
            for state_name in names:
                md = saved[prefix + state_name]
                if len(md.size) == 0:
                    value = torch.zeros((), dtype=md.properties.dtype,
                                        device=local_tensor(opt_param).device if on_device else "cpu")
                    targets[prefix + state_name] = Chunk(value, (), ())
                else:
                    value = torch.zeros_like(opt_param)
                    targets[prefix + state_name] = g.chunk(value, prefix + state_name)
                state[state_name] = value
            self._new_state[opt_param] = state
            if self.host:
                source = key(MASTER, name) if has_masters else key(MODEL, name)
                targets[key(MASTER, name)] = g.chunk(opt_param, f"host master of {name}", source)
        return targets

    def load_finish(self, loading: Loading) -> None:
        if self.optimizer is not None:
            _restore_optimizer(self.optimizer, self._new_state, loading.state["optimizer"], loading.path)
        self._new_state = {}


def _restore_optimizer(optimizer, new_state: dict, saved: Mapping[str, Any], path: Path) -> None:
    groups = saved.get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeConfigError(
            f"checkpoint {path} has {len(groups)} optimizer parameter group(s), the optimizer has "
            f"{len(optimizer.param_groups)}: build the optimizer the same way as the saved run"
        )
    for group, values in zip(optimizer.param_groups, groups):
        for k, v in values.items():
            current = group.get(k)
            if isinstance(current, tuple) and isinstance(v, list):
                v = tuple(v)
            elif isinstance(current, torch.Tensor):
                current.fill_(v)
                continue
            group[k] = v
    optimizer.state.clear()  # HostOffloadOptimizer: the wrapped optimizer's (shared) state dict
    for p, s in new_state.items():
        if s:
            optimizer.state[p] = s
    if isinstance(optimizer, HostOffloadOptimizer):  # device parameters from the (fp32) masters, as after a step
        with torch.no_grad():
            for p, master in zip(optimizer.device_params, optimizer.masters):
                local_tensor(p.data).copy_(master)
