from gemma_nb.rehearsal.nxd_layers import (  # noqa: F401
    BaseParallelLinear,
    ColumnParallelLinear,
    RowParallelLinear,
)
