from neuronx_distributed.parallel_layers import layers, mappings, parallel_state  # noqa: F401
