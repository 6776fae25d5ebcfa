"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Reference runs in the test process use one thread, as each launched rank does, so
    that their floating-point reductions run in the same order as the ranks'."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
