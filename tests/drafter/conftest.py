"""The drafter tests' tiny forwards run on one torch thread: its intra-op pool only adds
contention on a small machine (restored after each test, for the rest of the suite)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny forwards: torch's intra-op pool only adds contention on a small machine
    (restored after each test, for the rest of the suite)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
