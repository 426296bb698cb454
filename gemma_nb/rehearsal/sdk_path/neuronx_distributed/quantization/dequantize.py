from gemma_nb.rehearsal.nxd_quant import direct_cast_dequantize  # noqa: F401
from gemma_nb.rehearsal.nxd_quant import sdk_scale_dequantize as scale_dequantize  # noqa: F401
