"""Emulated torch-neuronx (gemma_nb.rehearsal, NOT the Neuron SDK): importable, nothing more."""

__emulated__ = True
__version__ = "2.9.0+emulated"
