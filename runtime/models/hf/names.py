"""Names the HF family's torch-free adapter and its torch modules share (this module imports nothing, so
the adapter can name them without importing torch, and the modules need not import the adapter)."""

#: Name of the method :func:`sp_plan.runtime.models.hf.model.add_hidden_states_method` gives an HF causal
#: LM: the tiled loss calls it, and FSDP2 registers it as a forward method.
HIDDEN_STATES_METHOD = "sp_plan_hidden_states"
