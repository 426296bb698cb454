"""Emulated ``trace/model_builder.py`` (v1). Importing it lets ``torch.jit.load`` read the emulated
artifacts, as importing the real one registers the classes a real artifact needs."""

import torch

from gemma_nb.rehearsal import nxd_model
from gemma_nb.rehearsal.nxd_builder import BaseModelInstance, ModelBuilder, append_default_compiler_flags  # noqa: F401

torch.jit.load = nxd_model.jit_load
