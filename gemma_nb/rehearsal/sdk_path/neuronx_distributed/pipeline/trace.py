"""Emulated NxD 0.18 ``pipeline/trace.py``: ``HFTracerWrapper`` from ``transformers.utils.fx`` (gone
in transformers 5)."""

import torch.fx
from transformers.utils.fx import HFTracer


class NxDTracer(torch.fx.Tracer):
    pass


class HFTracerWrapper(NxDTracer, HFTracer):
    pass
