from neuronx_distributed.utils import model_utils  # noqa: F401
