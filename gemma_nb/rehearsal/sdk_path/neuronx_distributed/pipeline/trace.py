"""Emulated: NxD 0.18 ``pipeline/trace.py`` defines ``HFTracerWrapper(NxDTracer, HFTracer)`` from
transformers' ``HFTracer`` whenever transformers is installed (``transformers.utils.fx``, which
transformers 5 removed)."""

import importlib.util

import torch.fx


class NxDTracer(torch.fx.Tracer):
    pass


if importlib.util.find_spec("transformers") is not None:
    from transformers.utils.fx import HFTracer

    class HFTracerWrapper(NxDTracer, HFTracer):
        pass
