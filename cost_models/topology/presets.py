"""Topology presets, references like ``dgx-h100@efa:32``, and YAML load/save with clear errors.

A reference is ``NAME[@FABRIC[:NICS]]`` where NAME is a shipped preset (``cost_models/data/
topologies/NAME.yaml``) or a path to a topology YAML file (told apart by
:func:`sp_plan.cost_models.data.resolve`), FABRIC one of the fabric presets (``_fabrics.yaml``) and NICS
the NICs per node. The GPU count then decides the node count: the same
node description, repeated.
"""

from __future__ import annotations

import datetime as _dt
import math
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from .. import data
from ..atomic_io import atomic_write_text
from ..errors import CostModelError
from ..gpu_spec import canonical_gpu_name, get_gpu_preset
from ..yaml_io import parse_mapping, safe_load, validated
from .spec import MAX_GPUS_PER_NODE, MAX_NICS_PER_NODE, MAX_TOTAL_GPUS, FabricSpec, LinkCalibration, TopologySpec
from .topology import Topology

#: Real topology files are a few KB; anything larger is not one (and is refused before parsing): the bound
#: every user data file has.
MAX_TOPOLOGY_FILE_BYTES = data.MAX_USER_FILE_BYTES

#: The node each GPU model usually comes in, for ``default_topology`` (``--gpu`` without a topology).
NATURAL_NODE_PRESET: dict[str, str] = {
    "a100-40gb": "dgx-a100",
    "a100-80gb": "dgx-a100",
    "a800-80gb": "dgx-a800",
    "h100-80gb": "dgx-h100",
    "h100-96gb": "grand-teton-h100",
    "h800": "dgx-h800",
    "h200": "dgx-h200",
    "gh200": "quad-gh200",
    "gh200-144gb": "quad-gh200",
    "b200": "dgx-b200",
    "l40s": "l40s-pcie",
    "l20": "l20-pcie",
}


def preset_names() -> list[str]:
    """Shipped topology presets (files in ``cost_models/data/topologies``, minus ``_*`` helpers)."""
    return list(data.names("topologies"))


@cache
def _fabric_table() -> dict[str, dict[str, Any]]:
    return safe_load(data.read_text("topologies", "_fabrics"))["fabrics"]


def fabric_names() -> list[str]:
    return sorted(_fabric_table())


def fabric_description(name: str) -> str:
    return str(_fabric_table()[name].get("description", ""))


@cache
def _preset_spec(name: str) -> TopologySpec:
    return _spec_from_text(data.read_text("topologies", name), f"topology preset {name}")


def get_preset_spec(name: str) -> TopologySpec:
    """A shipped preset by name (case-insensitive); an unknown name gets the closest ones."""
    key = data.canonical("topologies", name)
    if key is None:
        raise data.unknown_name("topologies", name)
    return _preset_spec(key)


#: What a topology mapping holds (named in the error for anything else).
_TOPOLOGY_KEYS = "name, gpu, node (and fabric, calibration)"


def _spec_from_text(text: str, what: str) -> TopologySpec:
    return validated(TopologySpec, parse_mapping(text, what, _TOPOLOGY_KEYS), what)


def spec_from_dict(data: Any, what: str = "topology") -> TopologySpec:
    """Validate a parsed topology mapping, turning pydantic's report into one actionable line."""
    if not isinstance(data, dict):
        raise CostModelError(f"{what} must be a YAML mapping with {_TOPOLOGY_KEYS}")
    return validated(TopologySpec, data, what)


def load_spec_file(path: str | Path) -> TopologySpec:
    """Read and validate a topology YAML file (``yaml.safe_load``, size-bounded)."""
    path = Path(path).expanduser()
    text = data.read_user_text("topologies", path)
    spec = _spec_from_text(text, f"topology file {path}")
    if isinstance(spec.gpu, str):
        get_gpu_preset(spec.gpu)  # unknown GPU names fail here, with the list of presets
    return spec


def parse_reference(ref: str) -> tuple[TopologySpec, str | None, int | None]:
    """Split ``NAME[@FABRIC[:NICS]]`` and load NAME; returns (spec, fabric, nics)."""
    text = str(ref).strip()
    if not text:
        raise CostModelError(f"empty topology name: use a preset ({', '.join(preset_names())}) or a YAML path")
    base, fabric, nics = text, None, None
    if "@" in text and not Path(text).expanduser().is_file():
        base, _, tail = text.rpartition("@")
        fabric, _, count = tail.partition(":")
        if count:
            try:
                nics = int(count)
            except ValueError:
                raise CostModelError(f"in {ref!r}, NICS after ':' must be an integer, e.g. dgx-h100@efa:32") from None
    found = data.resolve("topologies", base)
    spec = load_spec_file(found.path) if found.path is not None else _preset_spec(found.name)
    return spec, fabric, nics


def with_fabric(spec: TopologySpec, fabric: str | None, nics_per_node: int | None = None) -> TopologySpec:
    """Replace the spec's fabric by a fabric preset and/or change its NICs per node."""
    if fabric is None and nics_per_node is None:
        return spec
    if nics_per_node is not None and not 1 <= nics_per_node <= MAX_NICS_PER_NODE:
        raise CostModelError(f"NICs per node must be 1..{MAX_NICS_PER_NODE}, got {nics_per_node}")
    links = dict(spec.calibration.links)
    if fabric is not None:
        key = fabric.strip().lower()
        table = _fabric_table()
        if key not in table:
            raise CostModelError(f"unknown fabric {fabric!r}: choose one of {', '.join(fabric_names())}")
        entry = table[key]
        nics = nics_per_node or (spec.fabric.nics_per_node if spec.fabric else spec.node.gpus)
        new = FabricSpec(name=key, kind=entry["kind"], nics_per_node=nics, nic_bandwidth=entry["nic_bandwidth"],
                         latency=entry["latency"])
        links["fabric"] = LinkCalibration(**entry.get("calibration", {}))
    else:
        if spec.fabric is None:
            raise CostModelError(f"topology {spec.name} has no fabric to change NICs of; name one, e.g. @ib-ndr:8")
        new = spec.fabric.model_copy(update={"nics_per_node": nics_per_node})
    calibration = spec.calibration.model_copy(update={"links": links})
    return spec.model_copy(update={"fabric": new, "calibration": calibration})


def resize(spec: TopologySpec, num_gpus: int | None, gpus_per_node: int | None = None) -> TopologySpec:
    """The same node description repeated to hold ``num_gpus`` GPUs.

    ``gpus_per_node`` defaults to the node's GPU count, or to ``num_gpus`` when fewer GPUs than one node
    are asked for (a partial node). A node resized to a different GPU count keeps its host and scales
    PCIe switches and NICs so the GPUs per switch and NICs per GPU stay the same.
    """
    if num_gpus is None and gpus_per_node is None:
        return spec
    node = spec.node
    total = num_gpus if num_gpus is not None else spec.num_gpus
    if not 1 <= total <= MAX_TOTAL_GPUS:
        raise CostModelError(f"GPU count {total} is out of range: use 1 .. {MAX_TOTAL_GPUS}")
    gpn = gpus_per_node or (node.gpus if total >= node.gpus else total)
    if not 1 <= gpn <= MAX_GPUS_PER_NODE:
        raise CostModelError(f"GPUs per node must be 1..{MAX_GPUS_PER_NODE}, got {gpn}")
    if total < gpn:  # GPUs per node were given: "set GPUs per node" would be no advice
        raise CostModelError(f"{total} GPUs are fewer than the {gpn} GPUs per node asked for: give at least {gpn} "
                             f"GPUs (a multiple of {gpn}), or {total} GPUs per node for one partial node")
    if total % gpn:
        raise CostModelError(
            f"{total} GPUs do not fill whole nodes of {gpn}: use a multiple of {gpn} GPUs or set GPUs per node"
        )
    nodes = total // gpn
    if nodes > 1 and spec.fabric is None:
        raise CostModelError(
            f"topology {spec.name} has {spec.num_gpus} GPUs and no inter-node fabric; add a fabric section, "
            f"name one (e.g. {spec.name}@ib-ndr:8), or use at most {node.gpus} GPUs"
        )
    update: dict[str, Any] = {"nodes": nodes}
    if gpn != node.gpus:
        new_node: dict[str, Any] = {"gpus": gpn}
        if node.pcie is not None:
            new_node["pcie"] = node.pcie.model_copy(update={"gpus_per_switch": min(node.pcie.gpus_per_switch, gpn)})
        update["node"] = node.model_copy(update=new_node)
        if spec.fabric is not None:
            nics = max(1, min(MAX_NICS_PER_NODE, math.ceil(spec.fabric.nics_per_node * gpn / node.gpus)))
            update["fabric"] = spec.fabric.model_copy(update={"nics_per_node": nics})
    resized = spec.model_copy(update=update)
    # model_copy skips validation; validate the result once so bounds hold.
    return spec_from_dict(resized.model_dump(mode="python"), f"topology {spec.name}")


@cache
def _cached_topology(ref: str, num_gpus: int | None, gpus_per_node: int | None) -> Topology:
    spec, fabric, nics = parse_reference(ref)
    spec = with_fabric(spec, fabric, nics)
    return Topology(resize(spec, num_gpus, gpus_per_node))


def load_topology(preset_or_path: str | Path, num_gpus: int | None = None,
                  gpus_per_node: int | None = None) -> Topology:
    """A Topology from a preset name, ``NAME@FABRIC[:NICS]``, or a YAML path, resized to ``num_gpus``.

    Presets are cached (the planner asks for the same topology many times); files are re-read.
    """
    ref = str(preset_or_path)
    base = ref.rpartition("@")[0] if "@" in ref else ref
    if data.is_user_file("topologies", base):
        spec, fabric, nics = parse_reference(ref)
        return Topology(resize(with_fabric(spec, fabric, nics), num_gpus, gpus_per_node))
    return _cached_topology(ref.strip().lower(), num_gpus, gpus_per_node)


def natural_gpus_per_node(gpu_name: str) -> int:
    """GPUs per node of the machine ``gpu_name`` usually comes in (8 for DGX/HGX, 4 for quad GH200 nodes)."""
    gpu = canonical_gpu_name(gpu_name)
    preset = NATURAL_NODE_PRESET.get(gpu)
    return get_preset_spec(preset).node.gpus if preset is not None else 8


def default_topology(gpu_name: str, num_gpus: int, gpus_per_node: int | None = None) -> Topology:
    """The natural machine for ``gpu_name`` (DGX/HGX for data-centre GPUs, a PCIe server for L40S),
    with enough nodes for ``num_gpus`` GPUs over the node's usual fabric."""
    return _default_topology(canonical_gpu_name(gpu_name), num_gpus, gpus_per_node)


@cache
def _default_topology(gpu: str, num_gpus: int, gpus_per_node: int | None) -> Topology:
    get_gpu_preset(gpu)  # unknown GPU -> the GPU preset list
    preset = NATURAL_NODE_PRESET.get(gpu)
    if preset is None:
        raise CostModelError(f"no node preset for GPU {gpu}; pass a topology file or one of {', '.join(preset_names())}")
    spec = get_preset_spec(preset)
    if spec.gpu != gpu:
        spec = spec.model_copy(update={"gpu": gpu, "name": f"{spec.name}-{gpu}"})
    return Topology(resize(spec, num_gpus, gpus_per_node))


# ----- saving ------------------------------------------------------------------------------------


def _prune(value: Any) -> Any:
    """Drop unset (None) and empty-string fields so saved files stay short and readable."""
    if isinstance(value, dict):
        return {k: _prune(v) for k, v in value.items() if v is not None and v != ""}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def spec_to_yaml(spec: TopologySpec) -> str:
    data = _prune(spec.model_dump(mode="json"))
    return yaml.safe_dump(data, sort_keys=False, width=110, default_flow_style=False)


def save_topology(topology: Topology | TopologySpec, path: str | Path) -> Path:
    """Write a topology as YAML that :func:`load_topology` reads back to an equal spec."""
    spec = topology.spec if isinstance(topology, Topology) else topology
    path = Path(path).expanduser()
    header = f"# sp-plan topology, written {_dt.date.today().isoformat()}; edit calibration to tune predictions\n"
    atomic_write_text(path, header + spec_to_yaml(spec))  # whole or not at all; one-line errors
    return path
