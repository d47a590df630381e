"""Bridges from other training loops to the sp-plan runtime.

:mod:`sp_plan.runtime.integrations.transformers`: transformers' ``Trainer`` (and TRL's trainers built on it)
running the model :func:`sp_plan.runtime.auto.auto_configure` parallelised. Each bridge imports its
framework lazily: ``import sp_plan.runtime.integrations`` needs neither transformers nor TRL.
"""
