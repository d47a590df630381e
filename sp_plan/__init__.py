"""sp-plan: plan and run long-context LLM training with sequence parallelism.

The layers, each importing only those below it: :mod:`sp_plan.cli` -> :mod:`sp_plan.runtime` ->
:mod:`sp_plan.planner` -> :mod:`sp_plan.cost_models`. Their sources live in the repository's top-level
folders of the same names (``cli/``, ``runtime/``, ``planner/``, ``cost_models/``), mapped under this
package at install time, so nothing is installed under a generic top-level name.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sp-plan")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
