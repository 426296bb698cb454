from neuronx_distributed.trace import functions, model_builder, model_builder_v2, parallel_context  # noqa: F401
