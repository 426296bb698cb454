"""Neuron SDK 2.31 code paths (torch-neuronx, neuronx-distributed 0.19), one file per concern.

Nothing here imports the SDK at package import time: each function imports what it needs when
called, and raises ``gemma_nb.targets.TargetError`` with the install hint if it is missing. None of
it has been run on the cpu reference box; the notebooks say so where they call it.

- ``lm_head``: the port's vocab-parallel int8 lm_head (``QuantizedColumnParallel``).
- ``quant``: NxD's quantized dtypes, the SDK support matrix, and per-dtype trace trials.
- ``moe``: the port's DenseExperts and a selective-loading sparse path, and their benchmark.
- ``build``, ``deploy``: the ModelBuilder compile recipe at TP=2 and the slim deploy loader.
- ``artifact``: the folder the compile writes and the serving box reads (manifest, validation).
- ``sdk``: the one SDK import, and the transformers-5 ``transformers.utils.fx`` workaround.
"""
