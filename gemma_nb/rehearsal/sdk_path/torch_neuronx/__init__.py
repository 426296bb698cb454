"""Emulated torch-neuronx (gemma_nb.rehearsal, NOT the Neuron SDK): registers
``torch.classes.neuron.Runtime``."""

import types

import torch

from gemma_nb.rehearsal import spmd

__emulated__ = True
__version__ = "2.9.0+emulated"

torch.classes.neuron = types.SimpleNamespace(Runtime=spmd.Runtime)
