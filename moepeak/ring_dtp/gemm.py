"""Ring-DTP's GEMMs (all torch's), in the forms the schedules need: the product of two
same-dtype operands accumulated in fp32 and returned in fp32 (mm), written into an fp32
buffer (mm_f32_into), added into an fp32 accumulator (mm_f32_acc_) or into an output of the
operands' dtype (mm_acc_).

CUDA bf16/fp16: the fp32-output forms come straight from cuBLAS through torch's out_dtype
(torch >= 2.8) where this torch offers them; GEMM_FORMS knows which it offers (probed once,
see GemmForms), and a missing one is reported once through logging.getLogger("moepeak") with
the fallback taken. CPU bf16/fp16: the products of two bf16/fp16 numbers are exact in fp32,
so an fp32 GEMM of the upcast operands is the fp32-accumulating GEMM.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Tuple

import torch

LOG = logging.getLogger("moepeak")

# The fp32-output forms of torch's GEMMs for bf16/fp16 operands, and the fallback each has.
FORMS = {
    "mm": "torch.mm(a, b) rounded to the operands' dtype, then widened (the rounding naive F.linear has)",
    "mm_out": "the fp32 product made in pieces of 256 rows and copied into the buffer",
    "addmm_out": "the fp32 product made in a temporary and added into the accumulator",
}


def probe_form(form: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch compute `form` (FORMS) on `device` for `dtype` operands? Tried on 2 x 2
    operands and checked against the exact result; torch's error for a missing kernel or
    keyword (TypeError, NotImplementedError, RuntimeError) means no. An out-of-memory error
    is raised: it says nothing about the form."""
    a = torch.ones((2, 2), dtype=dtype, device=device)
    want = torch.full((2, 2), 2.0, dtype=torch.float32, device=device)
    try:
        if form == "mm":
            r = torch.mm(a, a, out_dtype=torch.float32)
        elif form == "mm_out":
            out = torch.empty((2, 2), dtype=torch.float32, device=device)
            r = torch.mm(a, a, out_dtype=torch.float32, out=out)
            if r.data_ptr() != out.data_ptr():
                return False
        elif form == "addmm_out":
            r = torch.zeros((2, 2), dtype=torch.float32, device=device)
            torch.addmm(r, a, a, out_dtype=torch.float32, out=r)
        else:
            raise ValueError(f"moepeak: form must be one of {tuple(FORMS)}, got {form!r}")
    except torch.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return r.dtype == torch.float32 and torch.equal(r, want)


class GemmForms:
    """Which FORMS this process's torch offers, per (form, device, dtype).

    Process-wide on purpose: the answer is a property of the installed torch and of the GPU,
    the same for every call of the process, and finding it costs a GEMM and a host sync.
    Each key is probed once (probe, default probe_form: on 2 x 2 operands, never on a call's
    own tensors, so an error of a real call is raised and not mistaken for a missing form),
    under a lock: forward runs on the caller's thread and a CUDA backward on autograd's
    device thread. A missing form is logged once, with the fallback the schedules take."""

    def __init__(self, probe: Callable[[str, torch.device, torch.dtype], bool] = probe_form):
        self._probe = probe
        self._known: Dict[Tuple[str, str, int, torch.dtype], bool] = {}
        self._lock = threading.Lock()

    def has(self, form: str, device: torch.device, dtype: torch.dtype) -> bool:
        index = device.index
        if index is None and device.type == "cuda":
            index = torch.cuda.current_device()
        key = (form, device.type, -1 if index is None else index, dtype)
        known = self._known.get(key)
        if known is not None:
            return known
        with self._lock:
            if key not in self._known:
                ok = bool(self._probe(form, device, dtype))
                self._known[key] = ok
                if not ok:
                    LOG.warning("moepeak: this torch (%s) has no fp32-output GEMM form %r for %s operands on %s; "
                                "Ring-DTP takes its fallback: %s", torch.__version__, form,
                                str(dtype).replace("torch.", ""), device, FORMS[form])
            return self._known[key]


GEMM_FORMS = GemmForms()


def mm(a: torch.Tensor, b: torch.Tensor, f32: bool) -> torch.Tensor:
    """a @ b for same-dtype a, b, accumulated in fp32; fp32 result if f32 else a.dtype.
    CUDA bf16/fp16 without the "mm" form: the result is rounded to a.dtype first (the same
    rounding the naive path has)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.device.type == "cuda":
        if f32 and GEMM_FORMS.has("mm", a.device, a.dtype):
            return torch.mm(a, b, out_dtype=torch.float32)
        r = torch.mm(a, b)
        return r.float() if f32 else r
    r = torch.mm(a.float(), b.float())
    return r if f32 else r.to(a.dtype)


def mm_f32_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out <- a @ b as fp32 (out: [m, n] x fp32, contiguous), no new [m, n] buffer where
    torch can write the fp32 GEMM result in place (fp32 operands; CUDA's "mm_out" form)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.device.type == "cuda" and GEMM_FORMS.has("mm_out", a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    for r0 in range(0, a.shape[0], 256):  # temporaries of <= 256 rows
        out[r0:r0 + 256].copy_(mm(a[r0:r0 + 256], b, True))
    return out


def mm_acc_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """out = a @ b (first) or out += a @ b, out in a's dtype, accumulated in fp32 inside
    the GEMM. Adding, CUDA's bf16/fp16 cuBLAS with beta = 1 rounds the product before adding
    it, rn(out + rn(a @ b)) (H200, probe_gemm_paths.py rounding), and the CPU path does the
    same (an fp32 GEMM of the operands, rounded, added in fp32, rounded), so CPU tests see
    the GPU's numerics. out: contiguous rows of a larger tensor."""
    if a.dtype == torch.float32 or a.device.type == "cuda":
        if first:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
        return
    if first:
        out.copy_(mm(a, b, True))
    else:
        out.add_(mm(a, b, False))


def mm_f32_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc (fp32) = a @ b (first) or acc += a @ b for same-dtype a, b: exact fp32 sums.
    CUDA bf16/fp16: one GEMM accumulating into the fp32 acc (the "addmm_out" form) where
    torch has it, else an fp32 GEMM result added."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=acc) if first else acc.addmm_(a, b)
        return
    if a.device.type != "cuda":
        acc.copy_(mm(a, b, True)) if first else acc.add_(mm(a, b, True))
    elif first:
        mm_f32_into(a, b, acc)
    elif GEMM_FORMS.has("addmm_out", a.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(mm(a, b, True))
