"""Testing hooks: switches tests and benchmarks may turn, and nothing else.

Each hook is a context manager that restores the previous state on exit, so a
failing test cannot leak its setting into the next one.

  force_grouped_mm(enabled, on_cpu=False)
      PipelinedLLEP's expert GEMMs through torch._grouped_mm (enabled=True;
      never where torch lacks it) or one torch.mm per expert (False); with
      on_cpu=True the grouped path is also taken on CPU tensors where torch
      supports it. Results are the same either way (up to GEMM summation order).
  grouped_mm_enabled()
      Whether the grouped path is still on (it switches itself off for the
      process the first time torch._grouped_mm raises).
  sco_extension(ext)
      SCO's engine (moepeak.sco.engine) makes its extension calls on ext in place
      of moepeak._C inside the block, e.g. a proxy that counts them.
  llep_transport(wrapper)
      PipelinedLLEP's ops talk to wrapper(transport) in place of their group's
      transport inside the block, e.g. a moepeak.core.Transport that counts
      the collectives and passes them on.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from .llep import gemm as llep_gemm
from .sco import engine as sco_engine


@contextlib.contextmanager
def force_grouped_mm(enabled: bool = True, *, on_cpu: bool = False) -> Iterator[None]:
    prev = llep_gemm.set_grouped_mm(enabled, on_cpu)
    try:
        yield
    finally:
        llep_gemm.set_grouped_mm(*prev)


def grouped_mm_enabled() -> bool:
    return llep_gemm.grouped_mm_settings()[0]


@contextlib.contextmanager
def sco_extension(ext) -> Iterator[object]:
    previous = sco_engine.use_extension(ext)
    try:
        yield ext
    finally:
        sco_engine.use_extension(previous)


@contextlib.contextmanager
def llep_transport(wrapper) -> Iterator[None]:
    from .llep import ops as llep_ops  # noqa: WPS433 (the ops' module: imported when the hook is used)
    previous = llep_ops.set_transport_wrapper(wrapper)
    try:
        yield
    finally:
        llep_ops.set_transport_wrapper(previous)


__all__ = ["force_grouped_mm", "grouped_mm_enabled", "sco_extension", "llep_transport"]
