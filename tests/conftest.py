import pathlib
import sys

# Tests run against the working tree (also from helper worktrees without an editable install).
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


#: The modules that take minutes (multi-rank training, validate runs, real launches), longest first. Alphabetical
#: collection puts most of them last (test_train*, test_training_equivalence, test_validate*), so one xdist worker
#: ran them alone for the last minutes of the suite; started first, the light modules fill the other worker.
SLOW_MODULES_FIRST = (
    "test_training_equivalence", "test_calibrate", "test_validate", "test_train_example", "test_validate_pipeline",
    "test_checkpoint_disk_full", "test_pipeline_runtime", "test_train_preemption", "test_cpu_prediction",
    "test_checkpoint_faults_more", "test_train_entry_point", "test_host_overhead", "test_peer_killed",
    "test_readme", "test_planner_properties", "test_stack_cli",
)


def pytest_collection_modifyitems(session, config, items):
    """Known-slow modules first, then every other module with multi-rank tests, then the rest; the order inside a
    module is kept (``--dist loadscope`` hands whole modules to a worker in this order)."""
    multiproc = {item.module.__name__.rsplit(".", 1)[-1] for item in items
                 if item.get_closest_marker("multiproc") and getattr(item, "module", None) is not None}

    def rank(item) -> tuple[int, int]:
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        if name in SLOW_MODULES_FIRST:
            return (0, SLOW_MODULES_FIRST.index(name))
        return (1, 0) if name in multiproc else (2, 0)

    items.sort(key=rank)  # stable: collection order within each group and module
