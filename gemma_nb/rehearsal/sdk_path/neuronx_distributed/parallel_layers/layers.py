from gemma_nb.rehearsal.nxd_layers import (
    BaseParallelLinear,
    ColumnParallelLinear,
    RowParallelLinear,
)  # noqa: F401
