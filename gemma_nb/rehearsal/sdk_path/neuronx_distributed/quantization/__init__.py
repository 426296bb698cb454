from neuronx_distributed.quantization import (  # noqa: F401
    dequantize,
    quantization_config,
    quantization_layers,
)
