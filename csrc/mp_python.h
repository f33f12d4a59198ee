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

/* Raise RuntimeError("moepeak was built without CUDA ...") for `what`. */
PyObject *mp_raise_no_cuda(const char *what);

/* Method tables, one per component (csrc/<component>.c). */
extern PyMethodDef mp_core_methods[];      /* cuda_rt.c: pinned memory, streams, events, pool */
extern PyMethodDef mp_adamw_methods[];     /* adamw.c: OffloadStreamAdamW */
extern PyMethodDef mp_ce_methods[];        /* ce.c: Ring-DTP cross-entropy kernels */
extern PyMethodDef mp_sco_methods[];       /* sco.c: selective checkpoint offload */
extern PyMethodDef mp_llep_methods[];      /* llep.c: PipelinedLLEP planner + permutation */
extern PyMethodDef mp_transport_methods[]; /* nccl.c: NCCL transport */

#endif
