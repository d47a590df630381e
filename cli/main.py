"""The ``sp-plan`` command line.

Subcommands live in ``sp_plan.cli.commands.<name>`` and are imported only when invoked, so ``sp-plan
--help`` stays fast and never pulls in heavy modules (and never torch). Every project error is
printed as one line on stderr with exit code 2, without a traceback; "nothing fits" answers (a
:class:`~sp_plan.planner.errors.NoFitError` or a command's own ``ctx.exit(1)``) exit 1.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from sp_plan.runtime.log import LEVEL_ENV, LEVELS, configure_logging

#: subcommand -> (module under sp_plan.cli.commands, one-line help shown by --help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("estimate", "Per-GPU memory, communication and time of one layout."),
    "plan": ("plan", "Search every layout and memory option; recommend the fastest that fits."),
    "capacity": ("capacity", "What-if: longest sequence, fewest GPUs, sweeps."),
    "export": ("export", "Write a plan as an Accelerate, DeepSpeed, Megatron-LM or torchrun config."),
    "topo": ("topo", "Show or convert a hardware topology (preset or YAML)."),
    "probe": ("probe", "Measure this machine's topology and links; --kernels: its kernels (needs torch)."),
    "validate": ("validate", "Run a few steps of a plan and compare measured with predicted."),
    "train": ("train", "Train with sp-plan's runtime, from a plan file or planning in place (needs torch)."),
    "calibrate": ("calibrate", "Fit efficiencies and overheads to your measured runs; write a calibration file."),
    "lengths": ("lengths", "Measure a dataset's document lengths (or show a lengths file or preset)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module = importlib.import_module(f"sp_plan.cli.commands.{SUBCOMMANDS[name][0]}")
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing must not import the subcommands: use the registry's short help.
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


#: ``--log-level``, on the group and on the commands that log (train).
LOG_LEVEL = click.Choice(LEVELS, case_sensitive=False)


def set_log_level(level: str | None) -> None:
    """Install the console handler of the ``sp_plan`` loggers (rank 0's lines on stdout); a level given here
    is also exported (``SP_PLAN_LOG_LEVEL``) so the ranks a command launches log alike."""
    if level is not None:
        os.environ[LEVEL_ENV] = level.lower()
    configure_logging(level)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sp-plan")
@click.option("--log-level", type=LOG_LEVEL, default=None,
              help="Messages shown: debug, info (default; or SP_PLAN_LOG_LEVEL), warning, error. Rank 0 only "
                   "(SP_PLAN_LOG_ALL_RANKS=1: every rank, prefixed).")
def cli(log_level: str | None) -> None:
    """Plan and run long-context LLM training with sequence parallelism."""
    set_log_level(log_level)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning project and validation errors into one-line messages."""
    from pydantic import ValidationError

    from sp_plan.cost_models.errors import CostModelError, explain_validation_error
    from sp_plan.planner.errors import NoFitError

    try:
        # Without standalone mode click *returns* the code a command exits with (``ctx.exit(1)``: no plan
        # fits) instead of raising it: pass it on, or every such answer would leave with status 0.
        code = cli.main(args=argv, standalone_mode=False)
    except NoFitError as exc:  # a valid question whose answer is "nothing fits": exit 1, as README promises
        click.echo(f"no fit: {exc}", err=True)
        sys.exit(1)
    except CostModelError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except ValidationError as exc:  # a boundary a command forgot to convert: still one line, no traceback
        click.echo(f"error: {explain_validation_error(exc, 'input')}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except RecursionError:  # a pathologically nested input that slipped past a reader's own bound
        click.echo("error: the input is nested too deeply to read; give a flat file of the documented format",
                   err=True)
        sys.exit(2)
    except RuntimeError as exc:  # a torchrun worker whose peer died: gloo/NCCL's traceback becomes one line
        from sp_plan.runtime.peer_loss import peer_lost_line

        line = peer_lost_line(exc)
        if line is None:
            raise
        click.echo(f"error: {line}", err=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # no interpreter teardown over a broken process group (see runtime/distributed.finish_worker)
    except OSError as exc:  # a file the user named cannot be read or written: name it, no traceback
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        click.echo(f"error: cannot access{where}: {exc.strerror or exc}", err=True)
        sys.exit(2)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
