"""``sp-plan topo``: show topology presets and files, resize them, and write them as YAML."""

from __future__ import annotations


import click

from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.topology.spec import MAX_GPUS_PER_NODE
from sp_plan.cost_models.topology import (
    Topology,
    fabric_names,
    get_preset_spec,
    load_topology,
    preset_names,
    resize,
    save_topology,
    spec_to_yaml,
    with_fabric,
)
from sp_plan.cost_models.topology.presets import fabric_description, parse_reference
from sp_plan.cost_models.topology.render import render, topology_json

from .common import check_output_path


@click.group(name="topo", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Show or convert a hardware topology (preset or YAML)."""


@command.command("show")
@click.argument("topology", required=False, metavar="[PRESET|FILE]")
@click.option("--gpus", type=click.IntRange(1, 1 << 20), default=None,
              help="Resize to this many GPUs (adds nodes of the same kind).")
@click.option("--gpus-per-node", type=click.IntRange(1, MAX_GPUS_PER_NODE), default=None, help="GPUs per node.")
@click.option("--fabric", default=None, help=f"Inter-node fabric preset ({', '.join(fabric_names())}).")
@click.option("--nics-per-node", type=click.IntRange(1, 64), default=None, help="NICs per node on the fabric.")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Also write the (resized) topology as YAML to this file (- for standard output).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the topology and its derived link figures as JSON (bytes/s, seconds).")
def show(topology: str | None, gpus: int | None, gpus_per_node: int | None, fabric: str | None,
         nics_per_node: int | None, out: str | None, as_json: bool) -> None:
    """Print a topology: nodes, GPUs, link classes with bandwidth and latency, NICs, calibration.

    PRESET is a shipped machine (see `sp-plan topo list`), optionally with a fabric as
    NAME@FABRIC[:NICS] (e.g. dgx-h100@efa:32), or a path to a topology YAML file (e.g. from
    `sp-plan probe`). Without an argument, lists the presets.
    """
    if topology is None:
        _list(as_json)
        return
    if as_json and out == "-":
        raise click.UsageError("--json and --out - would both write standard output: give --out a file name")
    check_output_path(out, "--out")
    if fabric is not None or nics_per_node is not None:
        if "@" in topology:
            raise click.UsageError("give the fabric either in the name (NAME@FABRIC) or with --fabric, not both")
        spec, _, _ = parse_reference(topology)
        topo = Topology(resize(with_fabric(spec, fabric, nics_per_node), gpus, gpus_per_node))
    else:
        topo = load_topology(topology, num_gpus=gpus, gpus_per_node=gpus_per_node)
    _emit(topo, out, as_json)


def _emit(topo, out: str | None, as_json: bool) -> None:
    if as_json:
        click.echo(strict_dumps(topology_json(topo), indent=2))
        if out:
            click.echo(f"wrote {save_topology(topo, out)}", err=True)
        return
    if out == "-":  # the YAML is standard output; the rendering goes to standard error
        click.echo(render(topo), err=True)
        click.echo(spec_to_yaml(topo.spec), nl=False)
        return
    click.echo(render(topo))
    if out:
        path = save_topology(topo, out)
        click.echo(f"\nwrote {path}")


@command.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the presets as JSON.")
def list_presets(as_json: bool) -> None:
    """List topology presets and fabric presets."""
    _list(as_json)


def _list(as_json: bool = False) -> None:
    if as_json:
        presets = []
        for name in preset_names():
            spec = get_preset_spec(name)
            presets.append({"name": name, "gpus_per_node": spec.node.gpus,
                            "gpu": spec.gpu if isinstance(spec.gpu, str) else spec.gpu.name,
                            "interconnect": spec.node.interconnect.kind,
                            "fabric": ({"name": spec.fabric.name, "nics_per_node": spec.fabric.nics_per_node}
                                       if spec.fabric else None)})
        fabrics = [{"name": name, "description": fabric_description(name)} for name in fabric_names()]
        click.echo(strict_dumps({"topologies": presets, "fabrics": fabrics}, indent=2))
        return
    click.echo("Topology presets (one node each; --gpus adds nodes over the preset's fabric):")
    for name in preset_names():
        spec = get_preset_spec(name)
        fab = f"{spec.fabric.nics_per_node} x {spec.fabric.name}" if spec.fabric else "no fabric"
        click.echo(f"  {name:<12} {spec.node.gpus} x {spec.gpu if isinstance(spec.gpu, str) else spec.gpu.name}, "
                   f"{spec.node.interconnect.kind}, {fab}")
    click.echo("Fabric presets (use NAME@FABRIC[:NICS], e.g. dgx-h100@roce-400:8):")
    for name in fabric_names():
        click.echo(f"  {name:<12} {fabric_description(name)}")
