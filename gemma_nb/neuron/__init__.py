"""Neuron SDK 2.31 code paths (torch-neuronx, neuronx-distributed 0.19), one file per concern.

The SDK contracts were read in neuronx-distributed 0.18, the newest public source
(aws-neuron/neuronx-distributed, the Neuron 2.29 release). Nothing here imports the SDK at package
import time: each function imports what it needs when called, and raises
``gemma_nb.targets.TargetError`` with the install hint if it is missing. No NeuronCore has run
this code on the reference box; the notebooks say so where they call it. What a cpu can check,
it does: ``standins`` are cpu stand-ins of the NxD pieces the build uses (our code, keeping the
0.18 contracts), and ``emulate`` runs the build's graphs at TP=2 on two gloo ranks with them.

- ``lm_head``: the port's vocab-parallel int8 lm_head (``QuantizedColumnParallel``).
- ``quant``: NxD's quantized dtypes, the SDK support matrix, per-dtype trace trials, and the one
  ``scale_dequantize`` patch.
- ``moe``: the dense experts (the port's op) and a selective-loading sparse path, one weight layout.
- ``build``, ``deploy``: the ModelBuilder compile recipe at TP=2 and the slim deploy loader.
- ``standins``, ``emulate``: the cpu stand-ins and the TP=2 emulation (notebook 05).
"""
