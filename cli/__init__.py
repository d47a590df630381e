"""The ``sp-plan`` command line: the one layer that imports both the planner and the runtime.

Commands that only plan (estimate, plan, capacity, export, topo, calibrate) use the planner; those that
launch the runtime (validate, probe) import it lazily inside the command, so ``sp-plan --help`` and the
planning commands never import torch.
"""
