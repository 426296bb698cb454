"""Emulated ``trace/model_builder.py`` (v1): importing it lets ``torch.jit.load`` read emulated
artifacts, as the real one."""

import torch

from gemma_nb.rehearsal import nxd_model
from gemma_nb.rehearsal.nxd_builder import (  # noqa: F401
    BaseModelInstance,
    ModelBuilder,
    append_default_compiler_flags,
)

torch.jit.load = nxd_model.jit_load
