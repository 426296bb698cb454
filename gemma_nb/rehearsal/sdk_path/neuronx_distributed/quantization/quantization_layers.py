"""Emulated ``quantization/quantization_layers.py``: the layers look ``scale_dequantize`` up here at
call time, so ``gemma_nb.neuron.quant.patch_scale_dequantize(this module)`` reaches them, as on the box."""

import sys

from gemma_nb.rehearsal.standins import bind_quantized_layers
from neuronx_distributed.quantization.dequantize import direct_cast_dequantize, scale_dequantize  # noqa: F401

globals().update(bind_quantized_layers(sys.modules[__name__]))
