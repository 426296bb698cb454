from neuronx_distributed.pipeline import trace  # noqa: F401
