"""Serving the deployed model (``python -m gemma_nb serve``) and benchmarking any such server.

``runtimes`` (slim deploy, transformers, neuron; one generation: sampling, stop strings), ``schema``
(bodies, errors), ``app`` (admission, queue, routes), ``serve`` (the command, uvicorn's limits),
``client_bench`` (TTFT, ITL and tok/s of any OpenAI-compatible endpoint).
"""
