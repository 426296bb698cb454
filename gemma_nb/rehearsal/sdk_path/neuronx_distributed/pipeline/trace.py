"""Emulated NxD 0.18 ``pipeline/trace.py``: ``HFTracerWrapper`` from ``transformers.utils.fx`` (gone in transformers 5)."""

import importlib.util

import torch.fx


class NxDTracer(torch.fx.Tracer):
    pass


if importlib.util.find_spec("transformers") is not None:
    from transformers.utils.fx import HFTracer

    class HFTracerWrapper(NxDTracer, HFTracer):
        pass
