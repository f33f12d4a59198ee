/* cuda_rt.c: Python bindings for the shared runtime pieces: the CPU thread
 * pool's size, pinned host memory, streams, events and async copies. These
 * are the building blocks of the copy engines of SCO and StreamAdamW.
 * Pointers, streams and events cross the boundary as Python ints. In a
 * CPU-only build every CUDA entry point raises a clear RuntimeError. */
#include "mp_python.h"

static PyObject *py_get_num_threads(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  return PyLong_FromLong(mp_pool_default_threads());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
  (void)self;
  long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n < 0 || n > 256) {
    PyErr_Format(PyExc_ValueError, "moepeak: threads must be in [0, 256] (0 = all CPUs of this process), got %ld", n);
    return NULL;
  }
  mp_pool_set_default_threads((int)n);
  Py_RETURN_NONE;
}

static PyObject *py_pool_workers(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  return PyLong_FromLong(mp_pool_workers());
}

static PyObject *py_pool_trim(PyObject *self, PyObject *arg) {
  (void)self;
  long keep = PyLong_AsLong(arg);
  if (keep == -1 && PyErr_Occurred()) return NULL;
  if (keep < 0 || keep > 256) {
    PyErr_Format(PyExc_ValueError, "moepeak: pool_trim keep must be in [0, 256], got %ld", keep);
    return NULL;
  }
  mp_status st;
  MP_CALL_NOGIL(st, (mp_pool_trim((int)keep), MP_OK));
  Py_RETURN_NONE;
fail:
  return NULL;
}

#if MP_WITH_CUDA
#define MP_CALL(expr)                         \
  do {                                        \
    mp_status st_ = (expr);                   \
    if (st_ != MP_OK) return mp_raise_status(st_); \
  } while (0)
#define MP_NEED_CUDA(name) (void)0
#else
#define MP_NEED_CUDA(name) return mp_raise_no_cuda(name)
#endif

static PyObject *py_device_count(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
#if MP_WITH_CUDA
  int n = 0;
  if (mp_cu_device_count(&n) != MP_OK) n = 0; /* no driver / no device: 0, like torch */
  return PyLong_FromLong(n);
#else
  return PyLong_FromLong(0);
#endif
}

static PyObject *py_set_device(PyObject *self, PyObject *arg) {
  (void)self;
  long d = PyLong_AsLong(arg);
  if (d == -1 && PyErr_Occurred()) return NULL;
  if (d < 0) {
    PyErr_Format(PyExc_ValueError, "moepeak: device must be >= 0, got %ld", d);
    return NULL;
  }
#if MP_WITH_CUDA
  MP_CALL(mp_cu_set_device((int)d));
  Py_RETURN_NONE;
#else
  MP_NEED_CUDA("set_device");
#endif
}

long long mp_arg_nbytes(PyObject *arg, const char *what) {
  long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return -1;
  if (n <= 0) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s nbytes must be > 0, got %lld", what, n);
    return -1;
  }
  return n;
}

PyObject *mp_py_pinned_alloc(PyObject *arg, const char *what, const char *need,
                             mp_status (*alloc)(void **ptr, long long nbytes)) {
  long long n = mp_arg_nbytes(arg, what);
  if (n < 0) return NULL;
#if MP_WITH_CUDA
  (void)need;
  void *p = NULL;
  mp_status st;
  MP_CALL_NOGIL(st, alloc(&p, n));
  return PyLong_FromVoidPtr(p);
fail:
  return NULL;
#else
  (void)alloc;
  return mp_raise_no_cuda(need);
#endif
}

PyObject *mp_py_pinned_free(PyObject *arg, const char *need) {
  void *p = PyLong_AsVoidPtr(arg);
  if (p == NULL && PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  (void)need;
  mp_status st;
  if (p) MP_CALL_NOGIL(st, mp_cu_host_free(p));
  Py_RETURN_NONE;
fail:
  return NULL;
#else
  return mp_raise_no_cuda(need);
#endif
}

#if MP_WITH_CUDA
static mp_status host_alloc(void **ptr, long long nbytes) { return mp_cu_host_alloc(ptr, (size_t)nbytes); }
#else
#define host_alloc NULL
#endif

/* host_alloc(nbytes) -> ptr: page-locked, portable host memory. */
static PyObject *py_host_alloc(PyObject *self, PyObject *arg) {
  (void)self;
  return mp_py_pinned_alloc(arg, "host_alloc", "pinned host memory (host_alloc)", host_alloc);
}

static PyObject *py_host_free(PyObject *self, PyObject *arg) {
  (void)self;
  return mp_py_pinned_free(arg, "host_free");
}

static PyObject *py_host_register(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long p, n;
  if (!PyArg_ParseTuple(args, "KK:host_register", &p, &n)) return NULL;
  if (p == 0 || n == 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: host_register needs a non-null ptr and nbytes > 0");
    return NULL;
  }
#if MP_WITH_CUDA
  mp_status st;
  MP_CALL_NOGIL(st, mp_cu_host_register((void *)(uintptr_t)p, (size_t)n));
  Py_RETURN_NONE;
fail:
  return NULL;
#else
  MP_NEED_CUDA("host_register");
#endif
}

static PyObject *py_host_unregister(PyObject *self, PyObject *arg) {
  (void)self;
  void *p = PyLong_AsVoidPtr(arg);
  if (p == NULL && PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  mp_status st;
  MP_CALL_NOGIL(st, mp_cu_host_unregister(p));
  Py_RETURN_NONE;
fail:
  return NULL;
#else
  MP_NEED_CUDA("host_unregister");
#endif
}

/* memcpy_async(dst, src, nbytes, stream): cudaMemcpyDefault (UVA decides the direction). */
static PyObject *py_memcpy_async(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long dst, src, n, stream;
  if (!PyArg_ParseTuple(args, "KKKK:memcpy_async", &dst, &src, &n, &stream)) return NULL;
  if (n > 0 && (dst == 0 || src == 0)) {
    PyErr_SetString(PyExc_ValueError, "moepeak: memcpy_async got a null pointer");
    return NULL;
  }
#if MP_WITH_CUDA
  MP_CALL(mp_cu_memcpy_async((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n, (uintptr_t)stream));
  Py_RETURN_NONE;
#else
  MP_NEED_CUDA("memcpy_async");
#endif
}

/* The runtime wrapper a binding calls; NULL in a CPU-only build (the binding
 * then raises mp_raise_no_cuda before calling it). */
#if MP_WITH_CUDA
#define MP_CU_FN(fn) fn
#else
#define MP_CU_FN(fn) NULL
#endif

/* A binding of one handle (a Python int): fn(handle), with the GIL released when
 * nogil, nothing for a null handle when skip_null; `name` in the no-CUDA error. */
static PyObject *call_on_handle(PyObject *arg, mp_status (*fn)(uintptr_t), int nogil, int skip_null,
                                const char *name) {
  unsigned long long h = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  (void)name;
  mp_status st = MP_OK;
  if (skip_null && !h) Py_RETURN_NONE;
  if (nogil) {
    MP_CALL_NOGIL(st, fn((uintptr_t)h));
    Py_RETURN_NONE;
  }
  return mp_return_none(fn((uintptr_t)h));
fail:
  return NULL;
#else
  (void)h, (void)fn, (void)nogil, (void)skip_null;
  return mp_raise_no_cuda(name);
#endif
}

/* A binding of an (event, stream) pair, parsed with `format` ("KK:name") in the order
 * the Python call takes them (event_first), the event non-null: fn(event, stream). */
static PyObject *call_on_event_stream(PyObject *args, const char *format, int event_first,
                                      mp_status (*fn)(uintptr_t event, uintptr_t stream), const char *name) {
  unsigned long long a, b;
  if (!PyArg_ParseTuple(args, format, &a, &b)) return NULL;
  const unsigned long long e = event_first ? a : b, s = event_first ? b : a;
  if (e == 0) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s got a null event", name);
    return NULL;
  }
#if MP_WITH_CUDA
  return mp_return_none(fn((uintptr_t)e, (uintptr_t)s));
#else
  (void)s, (void)fn;
  return mp_raise_no_cuda(name);
#endif
}

#if MP_WITH_CUDA
/* mp_cu_stream_wait_event with call_on_event_stream's argument order. */
static mp_status stream_wait_event(uintptr_t event, uintptr_t stream) { return mp_cu_stream_wait_event(stream, event); }
#endif

static PyObject *py_stream_create(PyObject *self, PyObject *args) {
  (void)self;
  int priority = 0;
  if (!PyArg_ParseTuple(args, "|i:stream_create", &priority)) return NULL;
#if MP_WITH_CUDA
  uintptr_t s = 0;
  MP_CALL(mp_cu_stream_create(&s, priority));
  return PyLong_FromUnsignedLongLong(s);
#else
  MP_NEED_CUDA("stream_create");
#endif
}

static PyObject *py_stream_destroy(PyObject *self, PyObject *arg) {
  (void)self;
  return call_on_handle(arg, MP_CU_FN(mp_cu_stream_destroy), 0, 0, "stream_destroy");
}

static PyObject *py_stream_synchronize(PyObject *self, PyObject *arg) {
  (void)self;
  return call_on_handle(arg, MP_CU_FN(mp_cu_stream_synchronize), 1, 0, "stream_synchronize");
}

static PyObject *py_stream_wait_event(PyObject *self, PyObject *args) {
  (void)self;
  return call_on_event_stream(args, "KK:stream_wait_event", 0, MP_CU_FN(stream_wait_event), "stream_wait_event");
}

static PyObject *py_event_create(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
#if MP_WITH_CUDA
  uintptr_t e = 0;
  MP_CALL(mp_cu_event_create(&e));
  return PyLong_FromUnsignedLongLong(e);
#else
  MP_NEED_CUDA("event_create");
#endif
}

static PyObject *py_event_destroy(PyObject *self, PyObject *arg) {
  (void)self;
  return call_on_handle(arg, MP_CU_FN(mp_cu_event_destroy), 0, 1, "event_destroy");
}

static PyObject *py_event_record(PyObject *self, PyObject *args) {
  (void)self;
  return call_on_event_stream(args, "KK:event_record", 1, MP_CU_FN(mp_cu_event_record), "event_record");
}

static PyObject *py_event_synchronize(PyObject *self, PyObject *arg) {
  (void)self;
  return call_on_handle(arg, MP_CU_FN(mp_cu_event_synchronize), 1, 0, "event_synchronize");
}

static PyObject *py_event_query(PyObject *self, PyObject *arg) {
  (void)self;
  unsigned long long e = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  int done = 0;
  MP_CALL(mp_cu_event_query((uintptr_t)e, &done));
  return PyBool_FromLong(done);
#else
  (void)e;
  MP_NEED_CUDA("event_query");
#endif
}

PyMethodDef mp_core_methods[] = {
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "Threads the CPU kernels use by default."},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n): default CPU kernel threads (0 = all)."},
    {"pool_workers", py_pool_workers, METH_NOARGS, "Worker threads of the CPU pool alive now."},
    {"pool_trim", py_pool_trim, METH_O, "pool_trim(keep): join the pool's workers beyond the first `keep`."},
    {"device_count", py_device_count, METH_NOARGS, "CUDA devices visible to moepeak's runtime (0 in a CPU build)."},
    {"set_device", py_set_device, METH_O, "set_device(index)"},
    {"host_alloc", py_host_alloc, METH_O, "host_alloc(nbytes) -> ptr: pinned (page-locked) host memory."},
    {"host_free", py_host_free, METH_O, "host_free(ptr)"},
    {"host_register", py_host_register, METH_VARARGS, "host_register(ptr, nbytes): pin existing host memory."},
    {"host_unregister", py_host_unregister, METH_O, "host_unregister(ptr)"},
    {"memcpy_async", py_memcpy_async, METH_VARARGS, "memcpy_async(dst, src, nbytes, stream)"},
    {"stream_create", py_stream_create, METH_VARARGS, "stream_create(priority=0) -> stream (non-blocking)"},
    {"stream_destroy", py_stream_destroy, METH_O, "stream_destroy(stream)"},
    {"stream_synchronize", py_stream_synchronize, METH_O, "stream_synchronize(stream) (GIL released)"},
    {"stream_wait_event", py_stream_wait_event, METH_VARARGS, "stream_wait_event(stream, event)"},
    {"event_create", py_event_create, METH_NOARGS, "event_create() -> event (timing disabled)"},
    {"event_destroy", py_event_destroy, METH_O, "event_destroy(event)"},
    {"event_record", py_event_record, METH_VARARGS, "event_record(event, stream)"},
    {"event_synchronize", py_event_synchronize, METH_O, "event_synchronize(event) (GIL released)"},
    {"event_query", py_event_query, METH_O, "event_query(event) -> bool (True when complete)"},
    {NULL, NULL, 0, NULL},
};
