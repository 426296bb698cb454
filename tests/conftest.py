"""Fixtures shared by the test files."""

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are op-overhead bound: one torch thread is fastest, and a second one only waits
    at a barrier per op (30-100x slower on a busy 2-core box). Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from gemma_nb.targets import torch_threads

    with torch_threads(1):
        yield
