"""Serving the deployed model: ``python -m gemma_nb serve`` and a client benchmark of any such server.

``generation`` (one generation over a ``Runtime``: sampling, stop strings), ``runtimes`` (the slim
deploy, transformers, the neuron deploy), ``schema`` (request and response bodies, errors), ``app``
(``create_app``: admission, the queue, the routes), ``serve`` (the command, uvicorn's limits,
``serve_in_thread``), ``client_bench`` (TTFT, ITL and tok/s of any OpenAI-compatible endpoint).
"""
