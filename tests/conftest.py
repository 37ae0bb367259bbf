import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped cleanly where there is no CUDA device (CI, laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
