"""``sp-plan probe``: measure this machine and write a topology file (imports torch only when run)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from sp_plan.cost_models.json_io import strict_dumps
from sp_plan.cost_models.errors import CostModelError
from sp_plan.cost_models.units import parse_seq_len

from .common import FiniteFloatRange, check_output_path

#: Bounds on message sizes: one byte-ish message is pure latency; 4 GiB is more than any link test needs.
MIN_SIZE, MAX_SIZE = 64, 4 << 30


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = sorted({parse_seq_len(tok.strip()) for tok in text.split(",") if tok.strip()})
    except CostModelError:
        raise click.BadParameter("use comma-separated byte counts with K/M/G suffixes, e.g. 4K,64K,1M") from None
    if len(sizes) < 3 or sizes[0] < MIN_SIZE or sizes[-1] > MAX_SIZE:
        raise click.BadParameter(f"give at least 3 distinct sizes between {MIN_SIZE} B and 4G")
    return sizes


@click.command(name="probe", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("topo.yaml"),
              show_default=True, help="Topology YAML to write (rank 0 writes it).")
@click.option("--sizes", default=None,
              help="Message sizes in bytes for link timings, e.g. 4K,64K,1M (default: small on CPU, up to 256M on GPUs).")
@click.option("--compute-budget", type=FiniteFloatRange(0.01, 60), default=None,
              help="Seconds per compute measurement.")
@click.option("--link-budget", type=FiniteFloatRange(0.1, 600), default=None,
              help="Seconds for all timings of one link class.")
@click.option("--name", default=None, help="Topology name (default: probe-<host>).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the probed topology and what was and was not measured as JSON (rank 0).")
def command(out: Path, sizes: str | None, compute_budget: float | None, link_budget: float | None,
            name: str | None, as_json: bool) -> None:
    """Discover GPUs, NVLink/PCIe, host and NICs; time links under torchrun; write a topology file.

    Run alone for discovery and compute, or under `torchrun --nproc-per-node N -m sp_plan.cli probe`
    (on one or more nodes) to also fit alpha and beta of the intra- and inter-node links. On a CPU-only
    machine the ranks are CPU processes over gloo. The file works with `--topology FILE` everywhere.
    """
    check_output_path(out, "--out")
    parsed = _sizes(sizes)
    try:
        from sp_plan.runtime.probe.run import run_probe
    except ImportError as exc:  # torch is an optional dependency of the planner
        raise CostModelError(f"sp-plan probe needs torch ({exc.name} is missing): pip install 'sp-plan[runtime]'") from exc
    result = run_probe(out, sizes=parsed, compute_budget_s=compute_budget, link_budget_s=link_budget, name=name)
    if as_json:
        if result.spec is not None:  # rank 0 writes the file and reports
            click.echo(strict_dumps({"path": str(result.path), "topology": result.spec.model_dump(mode="json")},
                                  indent=2))
    else:
        for line in result.lines:
            click.echo(line)
    if "WORLD_SIZE" in os.environ:  # a torchrun rank: leave before the interpreter's teardown can abort it
        from sp_plan.runtime.auto import finish_worker

        finish_worker()
