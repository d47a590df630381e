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
@click.option("--kernels", is_flag=True,
              help="Also time the GEMM and attention kernels the planner prices and fit a calibration file "
                   "(--out-calibration) from them; one process.")
@click.option("--out-calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --kernels: the calibration YAML to write (use it with --calibration FILE).")
@click.option("--topology", "topology_ref", default=None,
              help="With --kernels: the topology the calibration is for (a file `sp-plan probe` wrote here, or a "
                   "preset); default: probe this machine and write --out.")
@click.option("--model", default=None, help="With --kernels: the model whose layer shapes are timed (default "
              "llama3-8b; a preset or a config.json).")
@click.option("--seq-lens", default=None, help="With --kernels: sequence lengths, e.g. 4K,16K (default: 4K,16K,64K "
              "on GPUs, 128,256 on CPU).")
@click.option("--layout", "layouts", multiple=True, help="With --kernels: a layout whose local shapes are timed, "
              "e.g. ulysses=8 or tp=2,ring=4 (repeatable; default: none, ulysses=8 and ring=8 on GPUs; tp=8 and "
              "tp=8,ring=2 on CPU).")
@click.option("--stack", default=None, help="With --kernels: the stack whose attention kernel is timed and "
              "recorded (default sp-plan).")
@click.option("--budget", type=FiniteFloatRange(0.5, 3600), default=None,
              help="With --kernels: seconds for all kernel timings (default 30 on GPUs, 10 on CPU).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="With --kernels: the dtype timed (default bf16 on GPUs, fp32 on CPU).")
def command(out: Path, sizes: str | None, compute_budget: float | None, link_budget: float | None,
            name: str | None, as_json: bool, kernels: bool, out_calibration: Path | None, topology_ref: str | None,
            model: str | None, seq_lens: str | None, layouts: tuple[str, ...], stack: str | None,
            budget: float | None, dtype: str | None) -> None:
    """Discover GPUs, NVLink/PCIe, host and NICs; time links under torchrun; write a topology file.

    Run alone for discovery and compute, or under `torchrun --nproc-per-node N -m sp_plan.cli probe`
    (on one or more nodes) to also fit alpha and beta of the intra- and inter-node links. On a CPU-only
    machine the ranks are CPU processes over gloo. The file works with `--topology FILE` everywhere.

    With --kernels (one process): time the layer's GEMMs and the attention calls the planner prices for
    --model at --seq-lens and each --layout, fit the kernel model's GEMM and attention efficiencies and
    fixed costs to them (one timing in five held out), and write --out-calibration for
    `--calibration FILE` with this machine's topology (--topology, or the one probed and written to --out).
    """
    kernel_only = {"--out-calibration": out_calibration, "--topology": topology_ref, "--model": model,
                   "--seq-lens": seq_lens, "--layout": layouts or None, "--stack": stack, "--budget": budget,
                   "--dtype": dtype}
    if not kernels:
        given = [flag for flag, value in kernel_only.items() if value is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)}: only with --kernels (the kernel probe)")
    else:
        if out_calibration is None:
            raise click.UsageError("--kernels writes a calibration file: give --out-calibration FILE")
        if sizes is not None or link_budget is not None:
            raise click.UsageError("--kernels runs in one process and times no links: drop --sizes/--link-budget")
        if "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1":
            raise click.UsageError("--kernels times one device in one process: run it without torchrun")
        check_output_path(out_calibration, "--out-calibration")
        typed_out = click.get_current_context().get_parameter_source("out") == click.core.ParameterSource.COMMANDLINE
        if topology_ref is not None and typed_out:
            raise click.UsageError("--out names the topology to probe and write; with --topology nothing is probed: "
                                   "drop one of them")
    check_output_path(out, "--out")
    parsed = _sizes(sizes)
    try:
        from sp_plan.runtime.probe.run import run_probe
    except ImportError as exc:  # torch is an optional dependency of the planner
        raise CostModelError(f"sp-plan probe needs torch ({exc.name} is missing): pip install 'sp-plan[runtime]'") from exc
    if kernels:
        from .probe_kernels import run as run_kernels

        run_kernels(out, out_calibration, topology_ref, model, seq_lens, layouts, stack, budget, dtype,
                    compute_budget, name, as_json)
        return
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
