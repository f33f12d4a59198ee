"""torchtitan for the tests: skip a module only where torchtitan is absent or
cannot run on this torch (a torchtitan or triton import error); an import
error inside moepeak still fails."""
from __future__ import annotations

import pytest
import torch


def require_torchtitan():
    """The torchtitan package, or a module-level skip that names the reason."""
    try:
        import torchtitan
        import torchtitan.distributed.fsdp  # noqa: F401  torchtitan 0.3 needs torch >= 2.12's fsdp API
        import torchtitan.models.qwen3  # noqa: F401  needs triton at import time
    except ImportError as e:
        pytest.skip(f"torchtitan not usable with torch {torch.__version__}: {e}", allow_module_level=True)
    return torchtitan
