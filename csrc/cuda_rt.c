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

/* host_alloc(nbytes) -> ptr: page-locked, portable host memory. */
static PyObject *py_host_alloc(PyObject *self, PyObject *arg) {
  (void)self;
  long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return NULL;
  if (n <= 0) {
    PyErr_Format(PyExc_ValueError, "moepeak: host_alloc nbytes must be > 0, got %lld", n);
    return NULL;
  }
#if MP_WITH_CUDA
  void *p = NULL;
  mp_status st;
  MP_CALL_NOGIL(st, mp_cu_host_alloc(&p, (size_t)n));
  return PyLong_FromVoidPtr(p);
fail:
  return NULL;
#else
  MP_NEED_CUDA("pinned host memory (host_alloc)");
#endif
}

static PyObject *py_host_free(PyObject *self, PyObject *arg) {
  (void)self;
  void *p = PyLong_AsVoidPtr(arg);
  if (p == NULL && PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  mp_status st;
  if (p) MP_CALL_NOGIL(st, mp_cu_host_free(p));
  Py_RETURN_NONE;
fail:
  return NULL;
#else
  MP_NEED_CUDA("host_free");
#endif
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
  unsigned long long s = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  MP_CALL(mp_cu_stream_destroy((uintptr_t)s));
  Py_RETURN_NONE;
#else
  (void)s;
  MP_NEED_CUDA("stream_destroy");
#endif
}

static PyObject *py_stream_synchronize(PyObject *self, PyObject *arg) {
  (void)self;
  unsigned long long s = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  mp_status st;
  MP_CALL_NOGIL(st, mp_cu_stream_synchronize((uintptr_t)s));
  Py_RETURN_NONE;
fail:
  return NULL;
#else
  (void)s;
  MP_NEED_CUDA("stream_synchronize");
#endif
}

static PyObject *py_stream_wait_event(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long s, e;
  if (!PyArg_ParseTuple(args, "KK:stream_wait_event", &s, &e)) return NULL;
  if (e == 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: stream_wait_event got a null event");
    return NULL;
  }
#if MP_WITH_CUDA
  MP_CALL(mp_cu_stream_wait_event((uintptr_t)s, (uintptr_t)e));
  Py_RETURN_NONE;
#else
  MP_NEED_CUDA("stream_wait_event");
#endif
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
  unsigned long long e = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  if (e) MP_CALL(mp_cu_event_destroy((uintptr_t)e));
  Py_RETURN_NONE;
#else
  (void)e;
  MP_NEED_CUDA("event_destroy");
#endif
}

static PyObject *py_event_record(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long e, s;
  if (!PyArg_ParseTuple(args, "KK:event_record", &e, &s)) return NULL;
  if (e == 0) {
    PyErr_SetString(PyExc_ValueError, "moepeak: event_record got a null event");
    return NULL;
  }
#if MP_WITH_CUDA
  MP_CALL(mp_cu_event_record((uintptr_t)e, (uintptr_t)s));
  Py_RETURN_NONE;
#else
  MP_NEED_CUDA("event_record");
#endif
}

static PyObject *py_event_synchronize(PyObject *self, PyObject *arg) {
  (void)self;
  unsigned long long e = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
#if MP_WITH_CUDA
  mp_status st;
  MP_CALL_NOGIL(st, mp_cu_event_synchronize((uintptr_t)e));
  Py_RETURN_NONE;
fail:
  return NULL;
#else
  (void)e;
  MP_NEED_CUDA("event_synchronize");
#endif
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
