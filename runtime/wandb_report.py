"""Weights & Biases reporting of the trainer's per-step telemetry (rank 0), beside TensorBoard.

Optional: ``wandb`` comes with the ``[wandb]`` extra and is imported only when a project is given. The
run's config is the plan (model, layout, training options and its predicted step time and memory), so
runs can be compared by layout; every step logs the loss, tokens/s, the measured and the predicted step
time, model FLOP/s per rank, MFU where meaningful, lr, gradient norm and the memory figures (bytes,
maximum over ranks). Offline-safe: with ``WANDB_MODE=offline`` the run is written under ``WANDB_DIR``
and can be synced later (``wandb sync``).
"""

from __future__ import annotations

from typing import Any

from sp_plan.runtime.errors import RuntimeConfigError

#: What to tell a user who asked for W&B without the package.
MISSING = ("W&B reporting needs the wandb package: pip install 'sp-plan[wandb]' (or drop --wandb-project / "
           "wandb_project=)")


def import_wandb() -> Any:
    """The ``wandb`` module, or a :class:`RuntimeConfigError` saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise RuntimeConfigError(MISSING) from None
    return wandb


def plan_config(plan) -> dict[str, Any]:
    """The plan as W&B run config: model name and size, layout degrees, training options, predictions."""
    estimate = plan.estimate or {}
    return {"model": plan.model.name, "layout": plan.layout.model_dump(mode="json"),
            "train": plan.train.model_dump(mode="json"), "topology": plan.hardware.topology,
            "gpu": plan.hardware.gpu, "predicted_step_s": (estimate.get("time") or {}).get("step_s"),
            "predicted_memory_bytes": (estimate.get("memory") or {}).get("total")}


class WandbReporter:
    """One W&B run: :meth:`log` per step, :meth:`close` at the end. Create it on rank 0 only."""

    def __init__(self, project: str, plan, *, name: str | None = None, run_id: str | None = None) -> None:
        wandb = import_wandb()
        self.predicted_step_s = ((plan.estimate or {}).get("time") or {}).get("step_s")
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow" if run_id else None,
                              config=plan_config(plan))

    def log(self, record) -> None:
        """One :class:`sp_plan.runtime.trainer.StepRecord` as the step's W&B metrics."""
        values: dict[str, float] = {"train/loss": record.loss, "train/tokens_per_s": record.tokens_per_s,
                                    "train/step_seconds": record.seconds,
                                    "train/model_flops_per_s_per_rank": record.model_flops_per_s,
                                    "train/tokens": record.tokens, "train/skipped": float(record.skipped)}
        if self.predicted_step_s:
            values["train/predicted_step_seconds"] = self.predicted_step_s
        for key, value in (("train/mfu", record.mfu), ("train/lr", record.lr), ("train/grad_norm", record.grad_norm)):
            if value is not None:
                values[key] = value
        values.update({f"memory/{k}_bytes": v for k, v in record.memory.items()})
        self.run.log(values, step=record.step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
