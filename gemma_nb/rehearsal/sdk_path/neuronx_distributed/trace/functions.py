from gemma_nb.rehearsal.nxd_builder import shard_checkpoint_v2 as shard_checkpoint  # noqa: F401
