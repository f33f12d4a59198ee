"""Testing hooks: switches tests and benchmarks may turn, and nothing else.

Each hook is a context manager that restores the previous state on exit, so a
failing test cannot leak its setting into the next one. (PipelinedLLEP's GEMM choice is
no hook: it is the option grouped_mm of llep_moe, moepeak.llep.LLEPOptions.)

  sco_extension(offloader, ext)
      The engines of an SCOOffloader (those it has and those it makes inside the
      block) make their extension calls on ext in place of moepeak._C, e.g. a proxy
      that counts them (SCOOffloader.set_extension; no module state changes).
  llep_transport(wrapper)
      PipelinedLLEP's ops talk to wrapper(transport) in place of their group's
      transport inside the block, e.g. a moepeak.core.Transport that counts
      the collectives and passes them on.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def sco_extension(offloader, ext) -> Iterator[object]:
    previous = offloader.set_extension(ext)
    try:
        yield ext
    finally:
        offloader.set_extension(previous)


@contextlib.contextmanager
def llep_transport(wrapper) -> Iterator[None]:
    from .llep import ops as llep_ops  # noqa: WPS433 (the ops' module: imported when the hook is used)
    previous = llep_ops.set_transport_wrapper(wrapper)
    try:
        yield
    finally:
        llep_ops.set_transport_wrapper(previous)


__all__ = ["sco_extension", "llep_transport"]
