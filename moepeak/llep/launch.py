"""PipelinedLLEP's launch: the sizes one llep_moe call runs with, worked out from the call's
shapes and its LLEPOptions alone (never from the routing, so every rank of a group gets the
same numbers), through the byte formulas of moepeak/llep/sizes.py:

  chunk_rows      C, the rows per destination per chunk (on one rank never more than the
                  call's T*K rows; T*K itself on the lean one-chunk path);
  save_slots      chunks whose h [C, 2I] the activation cache keeps for backward;
  one_chunk_rows  P > 1: the most rows a rank may send or receive for the step to run as
                  one chunk (0: never);
  keep_one_chunk  P > 1: the one-chunk step keeps h and the grouped x rows for backward.

Launch.op_kwargs() are the schedule arguments of moepeak::llep_dispatch (moepeak/llep/ops.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .experts import lean_ok_static
from .options import LLEPOptions
from .sizes import (cache_slots, capped_save_bytes, default_chunk_rows, default_save_budget_mb, effective_chunk_rows,
                    ep_cache_room, one_chunk_ep_rows, one_chunk_fits)


@dataclass(frozen=True)
class Launch:
    options: LLEPOptions  # chunk_rows: the launch's C (an int)
    save_slots: int
    one_chunk_rows: int
    keep_one_chunk: bool

    def op_kwargs(self) -> dict:
        """The schedule arguments of moepeak::llep_dispatch, by name."""
        o = self.options
        return dict(chunk_rows=int(o.chunk_rows), alpha=float(o.alpha), min_tokens_per_gemm=int(o.min_tokens_per_gemm),
                    imbalance_threshold=float(o.imbalance_threshold), save_slots=int(self.save_slots),
                    one_chunk_rows=int(self.one_chunk_rows), keep_one_chunk=bool(self.keep_one_chunk),
                    grouped_mm=o.grouped_mm)


@dataclass(frozen=True)
class Shapes:
    """What the launch depends on besides the options: the group size P, the call's T
    tokens, K picks, E_local experts of sizes H and I, x's dtype, whether a gradient is
    needed, and the expert form (activation, split gate/up weights, biases)."""
    P: int
    T: int
    K: int
    E_local: int
    H: int
    I: int
    dtype: torch.dtype
    grad: bool
    activation: str = "swiglu"
    split: bool = False
    bias: bool = False

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def form(self) -> dict:
        """The expert form, as sizes' formulas take it (keywords)."""
        return dict(activation=self.activation, bias=self.bias, split=self.split)


def size_launch(options: LLEPOptions, s: Shapes) -> Launch:
    """The launch of one call (module docstring); options as the caller resolved them."""
    if options.chunk_rows is not None and options.chunk_rows < s.P:
        raise ValueError(f"moepeak: chunk_rows must be an int >= the number of ranks ({s.P}), "
                         f"got {options.chunk_rows!r}")
    b = s.elem_bytes
    C = effective_chunk_rows(default_chunk_rows(s.P) if options.chunk_rows is None else options.chunk_rows,
                             s.T, s.K, s.P)
    budget = (default_save_budget_mb(s.P) if options.save_budget_mb is None else options.save_budget_mb) << 20
    if s.P > 1 and options.save_budget_mb is None:  # the cache room within the chunk budget's bound
        budget += ep_cache_room(C, s.H, b)
    if _lean_one_chunk(options, s, C, budget):  # one chunk, h cached whole, backward's buffers held only while used
        return Launch(_with_rows(options, s.T * s.K), 1, 0, False)
    slots = 0
    if s.grad:
        slots = cache_slots(capped_save_bytes(budget, s.T, s.K, C, s.H, s.I, s.P, b, **s.form()),
                            s.T, s.K, C, s.I, s.P, b)
    one_rows, keep = 0, False
    if s.P > 1:  # from shapes, options and the arguments only: the same on every rank
        keep = s.grad and options.save_budget_mb != 0  # the one-chunk step keeps h and grouped x
        lean = lean_ok_static(s.activation, s.split, s.bias, s.dtype) and not torch.compiler.is_compiling()
        one_rows = one_chunk_ep_rows(C, s.H, s.I, s.P, b, budget, keep=keep, grad=s.grad, lean=lean,
                                     grouped=s.dtype == torch.bfloat16 and options.grouped_mm != "off", **s.form())
        if options.chunk_rows is not None:  # an explicit budget: one chunk only where it covers the step's rows
            one_rows = min(one_rows, C)
    return Launch(_with_rows(options, C), slots, one_rows, keep)


def _lean_one_chunk(options: LLEPOptions, s: Shapes, C: int, budget: int) -> bool:
    """On one rank with a gradient, the step runs as one chunk with its h cached whole
    (sizes.one_chunk_fits): with chunk_rows=None, or an explicit one that covers T*K."""
    return (s.grad and s.P == 1 and (options.chunk_rows is None or s.T * s.K <= C)
            and lean_ok_static(s.activation, s.split, s.bias, s.dtype)
            and one_chunk_fits(s.T, s.K, s.E_local, s.H, s.I, C, s.elem_bytes, budget, split=s.split))


def _with_rows(options: LLEPOptions, C: int) -> LLEPOptions:
    return dataclasses.replace(options, chunk_rows=int(C))


__all__ = ["Launch", "Shapes", "size_launch"]
