"""The TorchScript container of an emulated NxD artifact (no ``from __future__ import annotations``: TorchScript
reads the attribute annotations, in ``typing``'s names)."""

from typing import Dict, List  # noqa: UP035 (TorchScript reads these names)

import torch
from torch import nn


class Saved(nn.Module):
    """The TorchScript archive ``torch.jit.save`` writes: programs, each rank's weights, the spec."""

    # typing's names: TorchScript (torch 2.9) does not read builtin generics in attribute annotations
    weights: List[Dict[str, torch.Tensor]]  # noqa: UP006
    spec: str

    def __init__(self, programs: dict, weights: list, spec: str):
        super().__init__()
        self.programs = nn.ModuleDict(programs)
        self.weights = weights
        self.spec = spec

    def forward(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:  # noqa: UP006
        return torch.ops.nxd_emulated.spmd_model(inputs)  # unknown unless the emulated SDK is imported
