"""Measured runs (published GPU figures and the user's own), predictions for them, fitting and reports.

:mod:`.runs` defines a measured run and predicts its figure; :mod:`.published` turns the published
measurements into runs; :mod:`.fit` fits kernel-model and stack parameters to runs (scipy) with
leave-one-source-out cross-validation; :mod:`.user_runs` reads ``sp-plan validate --json`` output and
CSV files for ``sp-plan calibrate``.
"""
