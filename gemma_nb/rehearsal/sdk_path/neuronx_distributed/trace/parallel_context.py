from gemma_nb.rehearsal.nxd_builder import NxDParallelState  # noqa: F401
