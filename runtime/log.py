"""The ``sp_plan`` logger hierarchy and the one console handler an application installs on it.

Library code logs to ``logging.getLogger("sp_plan.<module>")`` and never configures handlers: a program
that embeds the runtime keeps control of its own logging. Applications (the ``sp-plan`` command, the
example script through :func:`sp_plan.runtime.train_run.run_training`) call :func:`configure_logging`
or :func:`ensure_logging`: one handler on the ``sp_plan`` logger, writing INFO lines as bare messages to
stdout (they are the program's output: plans, telemetry, checkpoints) and warnings and errors with
their level, and, by default, only on rank 0 of a distributed run (``all_ranks=True`` or
``SP_PLAN_LOG_ALL_RANKS=1`` prefixes every line with its rank instead). The level comes from the
argument, else ``SP_PLAN_LOG_LEVEL`` (which ``sp-plan --log-level`` sets, so ranks it launches inherit
it), else INFO. Torch-free.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

#: The root of the project's loggers.
ROOT = "sp_plan"
#: Environment variables: the level, and whether every rank's lines are shown.
LEVEL_ENV = "SP_PLAN_LOG_LEVEL"
ALL_RANKS_ENV = "SP_PLAN_LOG_ALL_RANKS"
LEVELS = ("debug", "info", "warning", "error")


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` inside the ``sp_plan`` hierarchy (``__name__`` of an sp_plan module)."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def process_rank() -> int:
    """This process's global rank under a launcher (``RANK``), else 0."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class RankFilter(logging.Filter):
    """Let rank 0's records through (or, with ``all_ranks``, every rank's, marked with the rank)."""

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = process_rank()
        record.rank_prefix = f"[rank {rank}] " if self.all_ranks else ""
        return self.all_ranks or rank == 0


class ConsoleFormatter(logging.Formatter):
    """INFO as the bare message (program output); other levels as ``level: message``."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            text += "\n" + self.formatException(record.exc_info)
        prefix = getattr(record, "rank_prefix", "")
        if record.levelno == logging.INFO:
            return prefix + text
        return f"{prefix}{record.levelname.lower()}: {text}"


def parse_level(level: str | int | None) -> int:
    """A level name (``debug`` .. ``error``, any case) or number; None: ``SP_PLAN_LOG_LEVEL`` or INFO."""
    if level is None:
        level = os.environ.get(LEVEL_ENV) or "info"
    if isinstance(level, int):
        return level
    name = str(level).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def configure_logging(level: str | int | None = None, *, all_ranks: bool | None = None,
                      stream: TextIO | None = None) -> logging.Handler:
    """Install (or replace) the console handler on the ``sp_plan`` logger and set its level; returns it."""
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        if getattr(handler, "sp_plan_console", False):
            logger.removeHandler(handler)
    if all_ranks is None:
        all_ranks = os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.sp_plan_console = True  # type: ignore[attr-defined]
    handler.setFormatter(ConsoleFormatter())
    handler.addFilter(RankFilter(all_ranks))
    logger.addHandler(handler)
    logger.setLevel(parse_level(level))
    logger.propagate = False  # printed once, whatever the root logger does
    return handler


def ensure_logging() -> None:
    """:func:`configure_logging` unless the application already configured the ``sp_plan`` logger or the
    root logger (an embedding program's own handlers win)."""
    if not logging.getLogger(ROOT).handlers and not logging.getLogger().handlers:
        configure_logging()
