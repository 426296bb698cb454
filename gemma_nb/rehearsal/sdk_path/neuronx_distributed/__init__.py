"""Emulated neuronx-distributed (gemma_nb.rehearsal, NOT the Neuron SDK), 0.18's import surface. As
in 0.18, it imports ``pipeline`` first, which imports ``transformers.utils.fx`` (gone in
transformers 5): the port's workaround meets it here."""

from neuronx_distributed import parallel_layers, pipeline, quantization, trace, utils  # noqa: F401
from neuronx_distributed.trace.functions import shard_checkpoint  # noqa: F401
from neuronx_distributed.trace.model_builder_v2 import ModelBuilder  # noqa: F401
from neuronx_distributed.trace.parallel_context import NxDParallelState  # noqa: F401

__emulated__ = True
__version__ = "0.18.0+emulated"
