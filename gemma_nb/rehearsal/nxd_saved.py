"""The TorchScript container of an emulated NxD artifact (kept apart: TorchScript reads its annotations).

No ``from __future__ import annotations`` here: ``torch.jit.script`` needs the attribute
annotations as objects, in ``typing``'s names (torch 2.9 reads no builtin generics there).
"""

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
