import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same RNG state; 2 threads match CI's 2 cores."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
