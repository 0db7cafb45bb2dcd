import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models on a 2-core machine: one intra-op thread per process is several times faster than two
    contending ones (tiny matmuls ran up to ~100x slower), and subprocess tests get a core of their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
