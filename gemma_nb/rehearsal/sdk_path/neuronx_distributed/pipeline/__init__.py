"""Emulated: NxD 0.18's pipeline package imports its HF tracer at package import time."""

from neuronx_distributed.pipeline import trace  # noqa: F401
