import os

import pytest
import torch

# Tests are sized for a 2-core machine; keep torch from oversubscribing it.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Fuzz tests (tests/test_fuzz_*.py, hypothesis): a small, derandomized example
# count by default so CI stays fast and reproducible; a deep run with e.g.
#   MOEPEAK_FUZZ_EXAMPLES=2000 MOEPEAK_FUZZ_RANDOM=1 python -m pytest tests/test_fuzz_*.py
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the fuzz tests skip themselves without hypothesis
    pass
else:
    settings.register_profile(
        "moepeak",
        max_examples=int(os.environ.get("MOEPEAK_FUZZ_EXAMPLES", "30")),
        deadline=None,
        derandomize=os.environ.get("MOEPEAK_FUZZ_RANDOM") != "1",
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    settings.load_profile("moepeak")


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
