from neuronx_distributed.trace import (  # noqa: F401
    functions,
    model_builder,
    model_builder_v2,
    parallel_context,
)
