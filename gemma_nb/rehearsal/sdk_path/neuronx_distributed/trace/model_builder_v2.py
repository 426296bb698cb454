"""Emulated ``trace/model_builder_v2.py``."""

from gemma_nb.rehearsal.nxd_builder import ModelBuilderV2 as ModelBuilder  # noqa: F401
