/* mp_python.h: helpers for the binding layer (C files that take PyObject*).
 * Every component's binding file defines a NULL-terminated PyMethodDef table
 * that module.c adds to moepeak._C at exec time. */
#ifndef MP_PYTHON_H
#define MP_PYTHON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "moepeak.h"

/* Raise the Python exception that matches a failed mp_status; returns NULL. */
PyObject *mp_raise_status(mp_status st);

/* The one no-GIL call idiom of every binding: evaluate `expr` (an mp_status
 * expression that touches no Python object) with the GIL released into `st`;
 * on failure raise the matching Python exception and `goto fail` (the
 * binding's cleanup label, which returns NULL). */
#define MP_CALL_NOGIL(st, expr)            \
  do {                                     \
    Py_BEGIN_ALLOW_THREADS(st) = (expr);   \
    Py_END_ALLOW_THREADS                   \
    if ((st) != MP_OK) {                   \
      mp_raise_status(st);                 \
      goto fail;                           \
    }                                      \
  } while (0)

/* A binding's return for a status: None, or the matching Python exception raised (NULL). */
static inline PyObject *mp_return_none(mp_status st) {
  if (st != MP_OK) return mp_raise_status(st);
  Py_RETURN_NONE;
}

/* A CPU kernel's binding tail: mp_parallel_for(n, grain, default threads, fn, ctx)
 * without the GIL; None, or the status raised. */
static inline PyObject *mp_py_parallel_for(int64_t n, int64_t grain, mp_range_fn fn, void *ctx) {
  mp_status st;
  MP_CALL_NOGIL(st, mp_parallel_for(n, grain, 0, fn, ctx));
  Py_RETURN_NONE;
fail:
  return NULL;
}

/* Raise RuntimeError("moepeak was built without CUDA ...") for `what`. */
PyObject *mp_raise_no_cuda(const char *what);

/* Pinned host memory for the bindings (csrc/cuda_rt.c). mp_arg_nbytes: a Python int
 * > 0, else -1 with ValueError "moepeak: <what> nbytes must be > 0". mp_py_pinned_alloc:
 * that many bytes from alloc (called without the GIL) as a Python int pointer;
 * mp_py_pinned_free: cudaFreeHost of a Python int pointer (0: nothing). Without CUDA
 * both raise mp_raise_no_cuda(need). */
long long mp_arg_nbytes(PyObject *arg, const char *what);
PyObject *mp_py_pinned_alloc(PyObject *arg, const char *what, const char *need,
                             mp_status (*alloc)(void **ptr, long long nbytes));
PyObject *mp_py_pinned_free(PyObject *arg, const char *need);

/* Method tables, one per component (csrc/<component>.c). */
extern PyMethodDef mp_core_methods[];      /* cuda_rt.c: pinned memory, streams, events, pool */
extern PyMethodDef mp_adamw_methods[];     /* adamw.c: StreamAdamW */
extern PyMethodDef mp_ce_methods[];        /* ce_bind.c: Ring-DTP cross-entropy kernels */
extern PyMethodDef mp_sco_methods[];       /* sco.c: selective checkpoint offload */
extern PyMethodDef mp_llep_methods[];      /* llep.c: PipelinedLLEP planner + permutation */
extern PyMethodDef mp_transport_methods[]; /* nccl.c: NCCL transport */
extern PyMethodDef mp_spill_methods[];     /* spill_bind.c: the disk tier's spill file */
extern PyMethodDef mp_abi_methods[];       /* abi.c: mp_abi.h's codes and row layouts (abi_info) */

#endif
