from gemma_nb.rehearsal.nxd_layers import (  # noqa: F401
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
