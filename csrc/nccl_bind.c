/* nccl_bind.c: Python bindings of the NCCL transport (csrc/nccl.c).
 * Only this file raises Python exceptions; every argument is validated here
 * before anything reaches NCCL. */
#include "mp_python.h" /* Python.h first */

#include <stdlib.h>
#include <string.h>

#include "mp_nccl.h"

/* ===========================================================================
 * Python bindings. Pointers, streams and communicator handles are ints;
 * counts are element counts of the given dtype code (NCCL's ncclDataType_t
 * values: int8 0, uint8 1, int32 2, uint32 3, int64 4, uint64 5, float16 6,
 * float32 7, float64 8, bfloat16 9). Every argument is checked before NCCL is
 * called; a bad one raises ValueError/TypeError naming it.
 * =========================================================================*/

static int mp_need_lib(void) {
  mp_status st = mp_nccl_load(NULL);
  if (st != MP_OK) {
    mp_raise_status(st);
    return -1;
  }
  return 0;
}

/* An int >= 0 (a Python int or anything with __index__). */
static int mp_arg_u64(PyObject *o, const char *name, uint64_t *out) {
  if (!PyIndex_Check(o)) {
    PyErr_Format(PyExc_TypeError, "moepeak: %s must be an int, got %s", name, Py_TYPE(o)->tp_name);
    return -1;
  }
  PyObject *v = PyNumber_Index(o);
  if (!v) return -1;
  int overflow = 0;
  long long sx = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (sx == -1 && !overflow && PyErr_Occurred()) { Py_DECREF(v); return -1; }
  if (overflow < 0 || (!overflow && sx < 0)) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s must be >= 0, got %R", name, v);
    Py_DECREF(v);
    return -1;
  }
  unsigned long long x = overflow ? PyLong_AsUnsignedLongLong(v) : (unsigned long long)sx;
  Py_DECREF(v);
  if (x == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s does not fit in 64 bits", name);
    return -1;
  }
  *out = x;
  return 0;
}

/* A count: >= 0 and below 2^48 elements (far above any device's memory). */
static int mp_arg_count(PyObject *o, const char *name, uint64_t *out) {
  if (mp_arg_u64(o, name, out) < 0) return -1;
  if (*out >= ((uint64_t)1 << 48)) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s = %llu elements is not a plausible count", name,
                 (unsigned long long)*out);
    return -1;
  }
  return 0;
}

/* A device pointer: non-null whenever `count` > 0. */
static int mp_arg_ptr(PyObject *o, const char *name, uint64_t count, uintptr_t *out) {
  uint64_t v;
  if (mp_arg_u64(o, name, &v) < 0) return -1;
  if (v == 0 && count > 0) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s is a null pointer but %llu elements were asked for", name,
                 (unsigned long long)count);
    return -1;
  }
  *out = (uintptr_t)v;
  return 0;
}

static int mp_arg_dtype(int dt) {
  if (dt < 0 || dt >= MP_NCCL_DTYPE_COUNT) {
    PyErr_Format(PyExc_ValueError, "moepeak: dtype code must be an NCCL data type in [0, %d), got %d",
                 MP_NCCL_DTYPE_COUNT, dt);
    return -1;
  }
  return 0;
}

static int mp_arg_peer(mp_comm *c, int peer, const char *name) {
  if (peer < 0 || peer >= c->nranks) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s must be a rank in [0, %d), got %d", name, c->nranks, peer);
    return -1;
  }
  return 0;
}

static mp_comm *mp_arg_comm(PyObject *o) {
  uint64_t h;
  if (mp_arg_u64(o, "comm", &h) < 0) return NULL;
  mp_comm *c = mp_comm_lookup(h);
  if (!c) PyErr_SetString(PyExc_ValueError, "moepeak: comm is not a live NCCL communicator handle "
                                            "(destroyed, or never returned by nccl_comm_init)");
  return c;
}

/* A counts sequence of exactly c->nranks ints >= 0, copied to out[]; *total = sum. */
static int mp_arg_counts(mp_comm *c, PyObject *o, const char *name, uint64_t *out, uint64_t *total) {
  char item[64];
  PyObject *seq = PySequence_Fast(o, "moepeak: counts must be a sequence of ints");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n != c->nranks) {
    PyErr_Format(PyExc_ValueError, "moepeak: %s must have one count per rank (%d), got %zd", name, c->nranks, n);
    Py_DECREF(seq);
    return -1;
  }
  *total = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    snprintf(item, sizeof item, "%s[%zd]", name, i);
    if (mp_arg_count(PySequence_Fast_GET_ITEM(seq, i), item, &out[i]) < 0) {
      Py_DECREF(seq);
      return -1;
    }
    *total += out[i];
    if (*total >= ((uint64_t)1 << 48)) {
      PyErr_Format(PyExc_ValueError, "moepeak: %s sum to an implausible count", name);
      Py_DECREF(seq);
      return -1;
    }
  }
  Py_DECREF(seq);
  return 0;
}

/* nccl_load(path=None) -> (version, how_found) */
static PyObject *py_nccl_load(PyObject *self, PyObject *args) {
  (void)self;
  const char *path = NULL;
  if (!PyArg_ParseTuple(args, "|z:nccl_load", &path)) return NULL;
  mp_status st = mp_nccl_load(path);
  if (st != MP_OK) return mp_raise_status(st);
  return Py_BuildValue("(is)", mp_nccl.version, mp_nccl.path);
}

/* nccl_loaded() -> (version, how_found) or None; never tries to load. */
static PyObject *py_nccl_loaded(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (!mp_nccl.lib) Py_RETURN_NONE;
  return Py_BuildValue("(is)", mp_nccl.version, mp_nccl.path);
}

static PyObject *py_nccl_get_unique_id(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (mp_need_lib() < 0) return NULL;
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  mp_status st = MP_OK;
  Py_BEGIN_ALLOW_THREADS
  ncclResult_t r = mp_nccl.GetUniqueId(&id);
  if (r != ncclSuccess) {
    mp_set_error(__FILE__, __LINE__, "ncclGetUniqueId failed: %s (ncclResult %d)", mp_nccl.GetErrorString(r), r);
    st = MP_ERR_NCCL;
  }
  Py_END_ALLOW_THREADS
  if (st != MP_OK) return mp_raise_status(st);
  return PyBytes_FromStringAndSize(id.internal, sizeof id.internal);
}

/* nccl_comm_init(unique_id: bytes, nranks, rank, device) -> comm handle.
 * device -1: use the calling thread's current device. Blocks (GIL released)
 * until every rank has joined. */
static PyObject *py_nccl_comm_init(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer uid;
  int nranks, rank, device;
  if (!PyArg_ParseTuple(args, "y*iii:nccl_comm_init", &uid, &nranks, &rank, &device)) return NULL;
  mp_comm *c = NULL;
  ncclUniqueId id;
  if (uid.len != MP_NCCL_UNIQUE_ID_BYTES) {
    PyErr_Format(PyExc_ValueError, "moepeak: unique_id must be %d bytes (from nccl_get_unique_id), got %zd",
                 MP_NCCL_UNIQUE_ID_BYTES, uid.len);
    goto fail;
  }
  memcpy(id.internal, uid.buf, MP_NCCL_UNIQUE_ID_BYTES);
  if (nranks < 1) {
    PyErr_Format(PyExc_ValueError, "moepeak: nranks must be >= 1, got %d", nranks);
    goto fail;
  }
  if (rank < 0 || rank >= nranks) {
    PyErr_Format(PyExc_ValueError, "moepeak: rank must be in [0, nranks=%d), got %d", nranks, rank);
    goto fail;
  }
  if (device < -1) {
    PyErr_Format(PyExc_ValueError, "moepeak: device must be a CUDA device index >= 0 (or -1: current), got %d",
                 device);
    goto fail;
  }
#if !MP_WITH_CUDA
  if (device >= 0) {
    mp_raise_no_cuda("an NCCL communicator on a given device");
    goto fail;
  }
#endif
  if (mp_need_lib() < 0) goto fail;
  c = (mp_comm *)calloc(1, sizeof *c);
  if (!c) {
    PyErr_NoMemory();
    goto fail;
  }
  c->nranks = nranks;
  c->rank = rank;
  c->device = device;
  mp_status st;
  MP_CALL_NOGIL(st, mp_nccl_comm_init(&id, nranks, rank, device, &c->comm));
  if (mp_comm_register(c) < 0) {
    (void)mp_nccl.CommAbort(c->comm);
    PyErr_Format(PyExc_RuntimeError, "moepeak: more than %d live NCCL communicators", MP_MAX_COMMS);
    goto fail;
  }
  PyBuffer_Release(&uid);
  return PyLong_FromVoidPtr(c);
fail:
  free(c);
  PyBuffer_Release(&uid);
  return NULL;
}

/* nccl_comm_destroy(comm, abort=False): destroy waits for the communicator's
 * pending work; abort does not wait (use it when a peer may be gone). */
static PyObject *py_nccl_comm_destroy(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h;
  int abort_ = 0;
  if (!PyArg_ParseTuple(args, "O|p:nccl_comm_destroy", &h, &abort_)) return NULL;
  mp_comm *c = mp_arg_comm(h);
  if (!c) return NULL;
  mp_comm_unregister(c); /* before the GIL is released: no other call can use it */
  ncclComm_t comm = c->comm;
  free(c);
  mp_status st = MP_OK;
  ncclResult_t r;
  Py_BEGIN_ALLOW_THREADS r = abort_ ? mp_nccl.CommAbort(comm) : mp_nccl.CommDestroy(comm);
  Py_END_ALLOW_THREADS
  if (r != ncclSuccess) {
    mp_set_error(__FILE__, __LINE__, "%s failed: %s (ncclResult %d)", abort_ ? "ncclCommAbort" : "ncclCommDestroy",
                 mp_nccl.GetErrorString(r), r);
    st = MP_ERR_NCCL;
    return mp_raise_status(st);
  }
  Py_RETURN_NONE;
}

/* nccl_comm_async_error(comm) -> (code, message); code 0 = no error. */
static PyObject *py_nccl_comm_async_error(PyObject *self, PyObject *arg) {
  (void)self;
  mp_comm *c = mp_arg_comm(arg);
  if (!c) return NULL;
  ncclResult_t a = ncclSuccess;
  ncclResult_t r = mp_nccl.CommGetAsyncError(c->comm, &a);
  if (r != ncclSuccess) a = r;
  return Py_BuildValue("(is)", a, mp_nccl.GetErrorString(a));
}

/* nccl_comm_info(comm) -> (nranks, rank, device) */
static PyObject *py_nccl_comm_info(PyObject *self, PyObject *arg) {
  (void)self;
  mp_comm *c = mp_arg_comm(arg);
  if (!c) return NULL;
  return Py_BuildValue("(iii)", c->nranks, c->rank, c->device);
}

static PyObject *py_nccl_group_start(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (mp_need_lib() < 0) return NULL;
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, mp_nccl.GroupStart());
  Py_RETURN_NONE;
fail:
  return mp_raise_status(st);
}

static PyObject *py_nccl_group_end(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (mp_need_lib() < 0) return NULL;
  mp_status st;
  MP_CALL_NOGIL(st, mp_nccl_group_end());
  Py_RETURN_NONE;
fail:
  return NULL;
}

/* nccl_send(comm, ptr, count, dtype, peer, stream) / nccl_recv(...): one half;
 * call them between nccl_group_start() and nccl_group_end(). */
static PyObject *mp_p2p(PyObject *args, int is_send) {
  PyObject *h, *po, *co, *so;
  int dt, peer;
  if (!PyArg_ParseTuple(args, is_send ? "OOOiiO:nccl_send" : "OOOiiO:nccl_recv", &h, &po, &co, &dt, &peer, &so))
    return NULL;
  mp_comm *c = mp_arg_comm(h);
  uint64_t count;
  uintptr_t ptr, stream;
  if (!c || mp_arg_count(co, "count", &count) < 0 || mp_arg_ptr(po, "ptr", count, &ptr) < 0 ||
      mp_arg_dtype(dt) < 0 || mp_arg_peer(c, peer, "peer") < 0 || mp_arg_ptr(so, "stream", 0, &stream) < 0)
    return NULL;
  mp_status st = MP_OK;
  if (is_send) MP_NCCL_CHECK(st, mp_nccl.Send((const void *)ptr, count, dt, peer, c->comm, (void *)stream));
  else MP_NCCL_CHECK(st, mp_nccl.Recv((void *)ptr, count, dt, peer, c->comm, (void *)stream));
  Py_RETURN_NONE;
fail:
  return mp_raise_status(st);
}
static PyObject *py_nccl_send(PyObject *self, PyObject *args) { (void)self; return mp_p2p(args, 1); }
static PyObject *py_nccl_recv(PyObject *self, PyObject *args) { (void)self; return mp_p2p(args, 0); }

/* nccl_send_recv(comm, send_ptr, send_count, dst, recv_ptr, recv_count, src, dtype, stream) */
static PyObject *py_nccl_send_recv(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h, *spo, *sco, *rpo, *rco, *so;
  int dst, src, dt;
  if (!PyArg_ParseTuple(args, "OOOiOOiiO:nccl_send_recv", &h, &spo, &sco, &dst, &rpo, &rco, &src, &dt, &so))
    return NULL;
  mp_comm *c = mp_arg_comm(h);
  uint64_t scount, rcount;
  uintptr_t sptr, rptr, stream;
  if (!c || mp_arg_count(sco, "send_count", &scount) < 0 || mp_arg_ptr(spo, "send_ptr", scount, &sptr) < 0 ||
      mp_arg_count(rco, "recv_count", &rcount) < 0 || mp_arg_ptr(rpo, "recv_ptr", rcount, &rptr) < 0 ||
      mp_arg_peer(c, dst, "dst") < 0 || mp_arg_peer(c, src, "src") < 0 || mp_arg_dtype(dt) < 0 ||
      mp_arg_ptr(so, "stream", 0, &stream) < 0)
    return NULL;
  mp_status st;
  MP_CALL_NOGIL(st, mp_nccl_send_recv(c, (const void *)sptr, scount, dst, (void *)rptr, rcount, src, dt, stream));
  Py_RETURN_NONE;
fail:
  return NULL;
}

/* nccl_all_to_all_v(comm, send_ptr, send_counts, recv_ptr, recv_counts, dtype, stream):
 * counts are per-rank element counts (see mp_nccl_all_to_all_v for the layout). */
static PyObject *py_nccl_all_to_all_v(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h, *spo, *sco, *rpo, *rco, *so;
  int dt;
  if (!PyArg_ParseTuple(args, "OOOOOiO:nccl_all_to_all_v", &h, &spo, &sco, &rpo, &rco, &dt, &so)) return NULL;
  mp_comm *c = mp_arg_comm(h);
  if (!c) return NULL;
  uint64_t *counts = (uint64_t *)calloc(2 * (size_t)c->nranks, sizeof *counts);
  if (!counts) return PyErr_NoMemory();
  uint64_t *sc = counts, *rc = counts + c->nranks, stot, rtot;
  uintptr_t sptr, rptr, stream;
  PyObject *ret = NULL;
  if (mp_arg_counts(c, sco, "send_counts", sc, &stot) < 0 || mp_arg_counts(c, rco, "recv_counts", rc, &rtot) < 0 ||
      mp_arg_ptr(spo, "send_ptr", stot, &sptr) < 0 || mp_arg_ptr(rpo, "recv_ptr", rtot, &rptr) < 0 ||
      mp_arg_dtype(dt) < 0 || mp_arg_ptr(so, "stream", 0, &stream) < 0)
    goto done;
  mp_status st;
  MP_CALL_NOGIL(st, mp_nccl_all_to_all_v(c, (const char *)sptr, sc, (char *)rptr, rc, dt, stream));
  ret = Py_None;
  Py_INCREF(ret);
fail:
done:
  free(counts);
  return ret;
}

/* The arguments all_reduce and all_gather share: (comm, send_ptr, recv_ptr,
 * count, dtype, stream), each checked as its own mp_arg_* does. 0 or -1 with
 * the Python error set. */
static int mp_arg_collective(PyObject *h, PyObject *spo, PyObject *rpo, PyObject *co, int dt, PyObject *so,
                             mp_comm **c, uint64_t *count, uintptr_t *sptr, uintptr_t *rptr, uintptr_t *stream) {
  *c = mp_arg_comm(h);
  if (!*c || mp_arg_count(co, "count", count) < 0 || mp_arg_ptr(spo, "send_ptr", *count, sptr) < 0 ||
      mp_arg_ptr(rpo, "recv_ptr", *count, rptr) < 0 || mp_arg_dtype(dt) < 0 || mp_arg_ptr(so, "stream", 0, stream) < 0)
    return -1;
  return 0;
}

/* nccl_all_reduce(comm, send_ptr, recv_ptr, count, dtype, op, stream); op: sum 0, prod 1, max 2, min 3.
 * send_ptr == recv_ptr is the in-place form. */
static PyObject *py_nccl_all_reduce(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h, *spo, *rpo, *co, *so;
  int dt, op;
  if (!PyArg_ParseTuple(args, "OOOOiiO:nccl_all_reduce", &h, &spo, &rpo, &co, &dt, &op, &so)) return NULL;
  mp_comm *c;
  uint64_t count;
  uintptr_t sptr, rptr, stream;
  if (mp_arg_collective(h, spo, rpo, co, dt, so, &c, &count, &sptr, &rptr, &stream) < 0) return NULL;
  if (op < 0 || op >= MP_NCCL_OP_COUNT) {
    PyErr_Format(PyExc_ValueError, "moepeak: op code must be in [0, %d) (sum, prod, max, min), got %d",
                 MP_NCCL_OP_COUNT, op);
    return NULL;
  }
  mp_status st;
  MP_CALL_NOGIL(st, mp_nccl_all_reduce(c, (const void *)sptr, (void *)rptr, count, dt, op, stream));
  Py_RETURN_NONE;
fail:
  return NULL;
}

/* nccl_all_gather(comm, send_ptr, recv_ptr, count, dtype, stream): count = elements per rank. */
static PyObject *py_nccl_all_gather(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h, *spo, *rpo, *co, *so;
  int dt;
  if (!PyArg_ParseTuple(args, "OOOOiO:nccl_all_gather", &h, &spo, &rpo, &co, &dt, &so)) return NULL;
  mp_comm *c;
  uint64_t count;
  uintptr_t sptr, rptr, stream;
  if (mp_arg_collective(h, spo, rpo, co, dt, so, &c, &count, &sptr, &rptr, &stream) < 0) return NULL;
  mp_status st;
  MP_CALL_NOGIL(st, mp_nccl_all_gather(c, (const void *)sptr, (void *)rptr, count, dt, stream));
  Py_RETURN_NONE;
fail:
  return NULL;
}

PyMethodDef mp_transport_methods[] = {
    {"nccl_load", py_nccl_load, METH_VARARGS, "nccl_load(path=None) -> (version, how_found): open libnccl once."},
    {"nccl_loaded", py_nccl_loaded, METH_NOARGS, "nccl_loaded() -> (version, how_found) or None; never loads."},
    {"nccl_get_unique_id", py_nccl_get_unique_id, METH_NOARGS, "nccl_get_unique_id() -> 128 bytes."},
    {"nccl_comm_init", py_nccl_comm_init, METH_VARARGS,
     "nccl_comm_init(unique_id, nranks, rank, device) -> comm; blocks until all ranks join (GIL released)."},
    {"nccl_comm_destroy", py_nccl_comm_destroy, METH_VARARGS, "nccl_comm_destroy(comm, abort=False)."},
    {"nccl_comm_async_error", py_nccl_comm_async_error, METH_O, "nccl_comm_async_error(comm) -> (code, message)."},
    {"nccl_comm_info", py_nccl_comm_info, METH_O, "nccl_comm_info(comm) -> (nranks, rank, device)."},
    {"nccl_group_start", py_nccl_group_start, METH_NOARGS, "ncclGroupStart()."},
    {"nccl_group_end", py_nccl_group_end, METH_NOARGS, "ncclGroupEnd() (GIL released)."},
    {"nccl_send", py_nccl_send, METH_VARARGS, "nccl_send(comm, ptr, count, dtype, peer, stream)."},
    {"nccl_recv", py_nccl_recv, METH_VARARGS, "nccl_recv(comm, ptr, count, dtype, peer, stream)."},
    {"nccl_send_recv", py_nccl_send_recv, METH_VARARGS,
     "nccl_send_recv(comm, send_ptr, send_count, dst, recv_ptr, recv_count, src, dtype, stream): one group."},
    {"nccl_all_to_all_v", py_nccl_all_to_all_v, METH_VARARGS,
     "nccl_all_to_all_v(comm, send_ptr, send_counts, recv_ptr, recv_counts, dtype, stream): one group."},
    {"nccl_all_reduce", py_nccl_all_reduce, METH_VARARGS,
     "nccl_all_reduce(comm, send_ptr, recv_ptr, count, dtype, op, stream)."},
    {"nccl_all_gather", py_nccl_all_gather, METH_VARARGS,
     "nccl_all_gather(comm, send_ptr, recv_ptr, count, dtype, stream)."},
    {NULL, NULL, 0, NULL},
};
