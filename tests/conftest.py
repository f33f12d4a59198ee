import os

import pytest
import torch

# Tests are sized for a 2-core machine; keep torch from oversubscribing it.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def _cuda_usable():
    try:
        import moepeak._C as C
    except ImportError:
        return False
    return bool(C.has_cuda) and torch.cuda.is_available()


CUDA_OK = _cuda_usable()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of moepeak")
    for item in items:
        if "cuda" in item.keywords and not CUDA_OK:
            item.add_marker(skip)
