from gemma_nb.rehearsal.nxd_quant import QuantizationType, QuantizedDtype, ScaleDtype  # noqa: F401
