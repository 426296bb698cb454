"""Serving the deployed model (``python -m gemma_nb serve``) and benchmarking any OpenAI-compatible
server."""
