"""The Neuron runtime's aliased state on the cpu, for the port's tests (no SDK needed)."""

import torch


class CpuStateGraph:
    """The cpu module as a graph: returned K/V written back into its state, as the runtime does;
    returns logits."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *inputs):
        outputs = self.module(*inputs)
        layers = len(self.module.k_cache)
        with torch.no_grad():
            for i in range(layers):
                self.module.k_cache[i].copy_(outputs[1 + i])
                self.module.v_cache[i].copy_(outputs[1 + layers + i])
        return outputs[0]
