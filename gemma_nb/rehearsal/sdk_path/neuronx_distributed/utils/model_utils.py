from gemma_nb.rehearsal.sharding import init_on_device  # noqa: F401
