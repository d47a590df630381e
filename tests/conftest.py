import pathlib
import sys

# Tests run against the working tree (also from helper worktrees without an editable install).
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
