"""Fixtures shared by the test files."""

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are op-overhead bound: one torch thread is fastest, and a second one only waits
    at a barrier per op (30-100x slower on a busy 2-core box). Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from gemma_nb.bench import torch_threads

    with torch_threads(1):
        yield


# tests/xla lower the neuron graphs with torch-xla: collected only in the xla environment
# (`make test-xla`, .venv-xla), never in the main one, which has no torch_xla.
def _has_torch_xla() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


collect_ignore = [] if _has_torch_xla() else ["xla"]
