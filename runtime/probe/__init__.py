"""``sp-plan probe``: discover this machine's topology and measure its links and compute.

Pure-Python pieces (parsing ``nvidia-smi topo -m``, reading NVML and the host, assembling the topology
file) import no torch; :mod:`sp_plan.runtime.probe.measure` and :mod:`sp_plan.runtime.probe.run` do, and are imported
only when the probe actually runs.
"""
