"""Emulated ``quantization/quantization_layers.py``: the layers look ``scale_dequantize`` up here,
where the port patches it."""

import sys

from gemma_nb.rehearsal.standins import bind_quantized_layers
from neuronx_distributed.quantization.dequantize import (  # noqa: F401
    direct_cast_dequantize,
    scale_dequantize,
)

globals().update(bind_quantized_layers(sys.modules[__name__]))
