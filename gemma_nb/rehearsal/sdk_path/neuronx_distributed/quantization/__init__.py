from neuronx_distributed.quantization import dequantize, quantization_config, quantization_layers  # noqa: F401
