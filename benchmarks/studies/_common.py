"""benchmarks/_common.py under its own name for the scripts in this folder.

A script run as `python benchmarks/studies/NAME.py` has this folder first on sys.path, so its
`from _common import ...` finds this file; it loads benchmarks/_common.py by path and puts
that module in its place, so both folders share one module object (one set of helpers).
"""
import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_common.py")
_spec = importlib.util.spec_from_file_location(__name__, _PATH)
_module = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _module
_spec.loader.exec_module(_module)
