from neuronx_distributed.parallel_layers import layers, mappings  # noqa: F401
