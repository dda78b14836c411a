import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same RNG state; 2 threads match CI's 2 cores."""
    torch.manual_seed(0)
    torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped here, run whenever a GPU is lent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
