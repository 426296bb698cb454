from gemma_nb.rehearsal.nxd_builder import ModelBuilderV2 as ModelBuilder  # noqa: F401
