"""Neuron SDK 2.31 code paths (torch-neuronx, neuronx-distributed 0.19), one file per concern.

The SDK contracts were read in neuronx-distributed 0.18, the newest public source
(aws-neuron/neuronx-distributed, the Neuron 2.29 release). Nothing here imports the SDK at package
import time: each function imports what it needs when called, and raises
``gemma_nb.targets.TargetError`` with the install hint if it is missing. No NeuronCore has run
this code; ``make rehearse`` runs it on a cpu against an emulation of the SDK surface it calls
(``gemma_nb.rehearsal``, which this package never imports; an SDK namespace may be passed in).

- ``lm_head``: the port's vocab-parallel int8 lm_head (``QuantizedColumnParallel``).
- ``quant``: NxD's quantized dtypes, the SDK support matrix, per-dtype trace trials, and the one
  ``scale_dequantize`` patch.
- ``moe``: the dense experts (the port's op) and the selective-loading decode, on NxD's
  expert-fused int8 layers, one expert-major weight layout.
- ``build``, ``deploy``: the ModelBuilder compile recipe at TP=2 and the slim deploy loader.
- ``checkpoint``: the hub checkpoint's text config and tensors.
- ``artifact``: the folder the compile writes and the serving box reads (manifest, validation).
- ``runs``: what notebooks 04, 05 and 07 run on the neuron target (every build, in turn).
- ``sdk``: the one SDK import, the transformers-5 ``transformers.utils.fx`` workaround, the runtime close.
"""
