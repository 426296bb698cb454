"""Emulated ``quantization/dequantize.py``: NxD 0.18's in-place ``scale_dequantize``."""

from gemma_nb.rehearsal.nxd_quant import direct_cast_dequantize  # noqa: F401
from gemma_nb.rehearsal.nxd_quant import sdk_scale_dequantize as scale_dequantize  # noqa: F401
