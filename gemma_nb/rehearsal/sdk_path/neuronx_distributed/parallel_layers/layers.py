"""Emulated ``parallel_layers/layers.py``: the stand-ins of gemma_nb.rehearsal.nxd_layers."""

from gemma_nb.rehearsal.nxd_layers import BaseParallelLinear, ColumnParallelLinear, RowParallelLinear, SPMDRank  # noqa: F401
