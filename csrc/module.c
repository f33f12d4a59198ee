/* module.c: the moepeak._C extension module (CPython C API only, multi-phase
 * init). Each component contributes one method table (mp_python.h); this
 * file adds them all and the attributes that describe the build. It also
 * owns the thread-local error message every C function reports through.
 *
 * Module state: m_size = 0, and the few globals stay static, because each is
 * process-wide by nature rather than per module object:
 *  - the CPU thread pool (threadpool.c): one set of worker threads for the
 *    process; two interpreters each with a pool would oversubscribe the cores;
 *  - the dlopen'ed libnccl and its symbol table (nccl.c): the library torch
 *    already loaded, once per process;
 *  - the live-communicator table (nccl_bind.c): NCCL communicators belong to
 *    the process and its devices;
 *  - the CUDA runtime state (device, primary context) is per process already;
 *  - the error message is thread-local, not module-wide.
 * No global holds a Python object, so module state would carry nothing a
 * sub-interpreter or a re-import could observe differently. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "mp_python.h"

/* ---- errors ------------------------------------------------------------ */
static _Thread_local char mp_err_buf[1024];

void mp_set_error(const char *file, int line, const char *fmt, ...) {
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  int n = snprintf(mp_err_buf, sizeof mp_err_buf, "%s:%d: ", base, line);
  if (n < 0 || (size_t)n >= sizeof mp_err_buf) n = 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(mp_err_buf + n, sizeof mp_err_buf - (size_t)n, fmt, ap);
  va_end(ap);
}

const char *mp_last_error(void) { return mp_err_buf[0] ? mp_err_buf : "unknown error"; }

PyObject *mp_raise_status(mp_status st) {
  PyObject *type = PyExc_RuntimeError;
  if (st == MP_ERR_INVALID) type = PyExc_ValueError;
  else if (st == MP_ERR_NOMEM) type = PyExc_MemoryError;
  PyErr_Format(type, "moepeak: %s", mp_last_error());
  mp_err_buf[0] = '\0';
  return NULL;
}

PyObject *mp_raise_no_cuda(const char *what) {
  PyErr_Format(PyExc_RuntimeError,
               "moepeak: %s needs CUDA, but moepeak._C was built without it "
               "(no nvcc at build time, or MOEPEAK_CUDA=0); rebuild with nvcc on PATH",
               what);
  return NULL;
}

/* ---- module ------------------------------------------------------------ */
/* The nvcc targets the CUDA objects were compiled for, comma-separated in
 * nvcc's spelling ("sm_80,...,sm_120,compute_120": SASS then PTX); setup.py
 * defines it. Empty for a CPU-only build. */
#ifndef MP_CUDA_ARCHS
#define MP_CUDA_ARCHS ""
#endif

/* moepeak._C.cuda_archs: MP_CUDA_ARCHS as a tuple of str (empty: ()). */
static int mp_add_cuda_archs(PyObject *m) {
  PyObject *text = NULL, *sep = NULL, *parts = NULL, *tuple = NULL;
  int rc = -1;
  if (MP_CUDA_ARCHS[0] == '\0') {
    tuple = PyTuple_New(0);
  } else {
    text = PyUnicode_FromString(MP_CUDA_ARCHS);
    sep = text ? PyUnicode_FromString(",") : NULL;
    parts = sep ? PyUnicode_Split(text, sep, -1) : NULL;
    tuple = parts ? PyList_AsTuple(parts) : NULL;
  }
  if (tuple == NULL) goto fail;
  if (PyModule_AddObject(m, "cuda_archs", tuple) < 0) goto fail;  /* steals tuple on success only */
  tuple = NULL;
  rc = 0;
fail:
  Py_XDECREF(tuple);
  Py_XDECREF(parts);
  Py_XDECREF(sep);
  Py_XDECREF(text);
  return rc;
}

static int mp_exec(PyObject *m) {
  PyMethodDef *tables[] = {mp_core_methods, mp_adamw_methods,     mp_ce_methods,   mp_sco_methods,
                           mp_llep_methods, mp_transport_methods, mp_spill_methods, mp_abi_methods};
  for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
    if (PyModule_AddFunctions(m, tables[i]) < 0) return -1;
  if (PyModule_AddIntConstant(m, "has_cuda", MP_WITH_CUDA) < 0) return -1;
  if (mp_add_cuda_archs(m) < 0) return -1;
  if (PyModule_AddIntConstant(m, "ISA_SCALAR", MP_ISA_SCALAR) < 0) return -1;
  if (PyModule_AddIntConstant(m, "ISA_AVX2", MP_ISA_AVX2) < 0) return -1;
  if (PyModule_AddIntConstant(m, "ISA_AVX512", MP_ISA_AVX512) < 0) return -1;
  if (PyModule_AddIntConstant(m, "best_isa", mp_cpu_best_isa()) < 0) return -1;
  return 0;
}

static PyModuleDef_Slot mp_slots[] = {
    {Py_mod_exec, (void *)mp_exec},
    {0, NULL},
};

static struct PyModuleDef mp_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "moepeak._C",
    .m_doc = "moepeak native kernels: CPU (C) and CUDA C arithmetic and transport.",
    .m_size = 0,
    .m_methods = NULL,
    .m_slots = mp_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&mp_module); }
