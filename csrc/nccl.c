/* nccl.c: the NCCL transport, called from C.
 *
 * What it does: opens libnccl at run time (dlopen, never linked), creates a
 * communicator from an ncclUniqueId the Python side broadcast over the user's
 * process group, and enqueues point-to-point and collective operations on a
 * stream the caller passes as an int. All data are device pointers given as
 * ints; nothing here allocates device memory (buffers come from torch).
 *
 * Why dlopen: a CPU build (and a machine without NCCL) must import moepeak._C,
 * and the process should share the one libnccl.so.2 torch already loaded.
 * Search order (nccl_load): the copy already in the process
 * (RTLD_NOLOAD), then the loader's search path, then the path the caller
 * gives or $MOEPEAK_NCCL_LIB. The NCCL types below are declared here; their
 * values are NCCL's stable public ABI (nccl.h since 2.x), so no nccl.h is
 * needed to build.
 *
 * Ordering rule (NCCL's, kept by the callers): every rank issues the same
 * operations on a communicator in the same order.
 *
 * Layer split: mp_nccl_* functions return an mp_status and record
 * "file:line: message"; only the py_* bindings raise Python exceptions, after
 * validating every argument (so bad input never reaches NCCL).
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "mp_python.h"

/* ---- the slice of nccl.h we use (public ABI) ---------------------------- */
typedef struct mp_ncclComm *ncclComm_t;
#define MP_NCCL_UNIQUE_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */
typedef struct { char internal[MP_NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
typedef int ncclResult_t; /* ncclSuccess = 0, ncclInProgress = 7 */
enum { ncclSuccess = 0, ncclInProgress = 7 };
/* ncclDataType_t: the codes the bindings accept (MP_DT_* == NCCL's values). */
enum {
  MP_DT_INT8 = 0, MP_DT_UINT8 = 1, MP_DT_INT32 = 2, MP_DT_UINT32 = 3, MP_DT_INT64 = 4,
  MP_DT_UINT64 = 5, MP_DT_FLOAT16 = 6, MP_DT_FLOAT32 = 7, MP_DT_FLOAT64 = 8, MP_DT_BFLOAT16 = 9,
  MP_DT_COUNT = 10
};
static const size_t mp_dt_size[MP_DT_COUNT] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
/* ncclRedOp_t: sum, prod, max, min (avg exists but is not offered). */
enum { MP_OP_SUM = 0, MP_OP_PROD = 1, MP_OP_MAX = 2, MP_OP_MIN = 3, MP_OP_COUNT = 4 };

/* ---- the loaded library -------------------------------------------------- */
typedef struct {
  void *lib;
  char path[512]; /* how it was found, for messages */
  int version;    /* NCCL_VERSION_CODE, e.g. 22703 for 2.27.3 */
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*Send)(const void *, size_t, int, int, ncclComm_t, void *);
  ncclResult_t (*Recv)(void *, size_t, int, int, ncclComm_t, void *);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, int, int, ncclComm_t, void *);
  ncclResult_t (*AllGather)(const void *, void *, size_t, int, ncclComm_t, void *);
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t); /* optional (NCCL >= 2.13) */
} mp_nccl_lib;

static mp_nccl_lib N; /* N.lib != NULL once loaded; guarded by the GIL */

/* Record the failed call, NCCL's error string and its last detailed message.
 * `call` is always N.<Name>(...); "nccl" + (#call + 2) prints ncclName(...). */
#define MP_NCCL_CHECK(status_var, call)                                                       \
  do {                                                                                        \
    ncclResult_t r_ = (call);                                                                 \
    if (r_ != ncclSuccess) {                                                                  \
      const char *last_ = N.GetLastError ? N.GetLastError(NULL) : NULL;                       \
      MP_FAIL(status_var, MP_ERR_NCCL, "nccl%s failed: %s (ncclResult %d)%s%s", #call + 2,            \
              N.GetErrorString ? N.GetErrorString(r_) : "?", r_,                              \
              (last_ && last_[0]) ? "; NCCL says: " : "", (last_ && last_[0]) ? last_ : "");  \
    }                                                                                         \
  } while (0)

static mp_status mp_nccl_resolve(void *lib, const char *how) {
  mp_status st = MP_OK;
  mp_nccl_lib t;
  memset(&t, 0, sizeof t);
#define MP_SYM(field, name)                                                                   \
  do {                                                                                        \
    *(void **)(&t.field) = dlsym(lib, name);                                                  \
    if (!t.field) MP_FAIL(st, MP_ERR_SYS, "NCCL library %s lacks the symbol %s", how, name);  \
  } while (0)
  MP_SYM(GetVersion, "ncclGetVersion");
  MP_SYM(GetUniqueId, "ncclGetUniqueId");
  MP_SYM(CommInitRank, "ncclCommInitRank");
  MP_SYM(CommDestroy, "ncclCommDestroy");
  MP_SYM(CommAbort, "ncclCommAbort");
  MP_SYM(CommGetAsyncError, "ncclCommGetAsyncError");
  MP_SYM(GroupStart, "ncclGroupStart");
  MP_SYM(GroupEnd, "ncclGroupEnd");
  MP_SYM(Send, "ncclSend");
  MP_SYM(Recv, "ncclRecv");
  MP_SYM(AllReduce, "ncclAllReduce");
  MP_SYM(AllGather, "ncclAllGather");
  MP_SYM(GetErrorString, "ncclGetErrorString");
#undef MP_SYM
  *(void **)(&t.GetLastError) = dlsym(lib, "ncclGetLastError");
  if (t.GetVersion(&t.version) != ncclSuccess) MP_FAIL(st, MP_ERR_NCCL, "ncclGetVersion failed in %s", how);
  if (t.version < 20700) /* grouped send/recv (all-to-all-v) needs NCCL >= 2.7 */
    MP_FAIL(st, MP_ERR_NCCL, "NCCL %d from %s is too old: moepeak needs NCCL >= 2.7", t.version, how);
  t.lib = lib;
  snprintf(t.path, sizeof t.path, "%s", how);
  N = t;
fail:
  return st;
}

/* Load libnccl once (the first success sticks). `path` may be NULL. */
static mp_status mp_nccl_load(const char *path) {
  mp_status st = MP_OK;
  if (N.lib) return MP_OK;
  char tried[768] = "";
  void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  const char *how = "libnccl.so.2 (already loaded, e.g. by torch)";
  if (!lib) {
    lib = dlopen("libnccl.so.2", RTLD_NOW);
    how = "libnccl.so.2 (loader search path)";
    if (!lib) snprintf(tried, sizeof tried, "dlopen(libnccl.so.2): %s", dlerror());
  }
  const char *env = getenv("MOEPEAK_NCCL_LIB");
  const char *user[2] = {path, env};
  for (int i = 0; i < 2 && !lib; i++) {
    if (!user[i] || !user[i][0]) continue;
    lib = dlopen(user[i], RTLD_NOW);
    how = user[i];
    if (!lib) {
      size_t n = strlen(tried);
      snprintf(tried + n, sizeof tried - n, "; dlopen(%s): %s", user[i], dlerror());
    }
  }
  if (!lib)
    MP_FAIL(st, MP_ERR_SYS,
            "NCCL not found (%s). Install NCCL (it ships with CUDA builds of torch: "
            "pip install nvidia-nccl-cu12/cu13) or set MOEPEAK_NCCL_LIB to libnccl.so.2's path",
            tried);
  MP_TRY(st, mp_nccl_resolve(lib, how));
  return MP_OK;
fail:
  if (lib) dlclose(lib);
  return st;
}

/* ---- communicators ------------------------------------------------------- *
 * A handle is a pointer to mp_comm given to Python as an int. Live handles are
 * kept in a small table so a stale or made-up int is refused (ValueError), not
 * dereferenced. The table is guarded by the GIL (only touched while held). */
typedef struct {
  ncclComm_t comm;
  int nranks, rank, device;
} mp_comm;

#define MP_MAX_COMMS 256 /* far above any sane number of live communicators */
static mp_comm *mp_live[MP_MAX_COMMS];

static int mp_comm_register(mp_comm *c) {
  for (int i = 0; i < MP_MAX_COMMS; i++)
    if (!mp_live[i]) { mp_live[i] = c; return 0; }
  return -1;
}
static void mp_comm_unregister(mp_comm *c) {
  for (int i = 0; i < MP_MAX_COMMS; i++)
    if (mp_live[i] == c) mp_live[i] = NULL;
}
static mp_comm *mp_comm_lookup(unsigned long long h) {
  for (int i = 0; i < MP_MAX_COMMS; i++)
    if (h && (uintptr_t)mp_live[i] == (uintptr_t)h) return mp_live[i];
  return NULL;
}

/* Blocks until all `nranks` ranks have called it with the same id. */
static mp_status mp_nccl_comm_init(const ncclUniqueId *id, int nranks, int rank, int device, ncclComm_t *out) {
  mp_status st = MP_OK;
  *out = NULL;
#if MP_WITH_CUDA
  /* NCCL binds the communicator to the calling thread's current device. */
  if (device >= 0) MP_TRY(st, mp_cu_set_device(device));
#else
  (void)device;
#endif
  MP_NCCL_CHECK(st, N.CommInitRank(out, nranks, *id, rank));
fail:
  return st;
}

/* ---- operations ---------------------------------------------------------- *
 * `stream` is a cudaStream_t as an int; counts are in elements of `dt`. */

/* One grouped pair: send `scount` elements to `dst`, receive `rcount` from
 * `src` (either count may be 0: that half is skipped; the peer skips it too
 * because counts agree pairwise). */
static mp_status mp_nccl_send_recv(mp_comm *c, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                                   int src, int dt, uintptr_t stream) {
  mp_status st = MP_OK;
  int open = 0;
  MP_NCCL_CHECK(st, N.GroupStart());
  open = 1;
  if (scount) MP_NCCL_CHECK(st, N.Send(sbuf, scount, dt, dst, c->comm, (void *)stream));
  if (rcount) MP_NCCL_CHECK(st, N.Recv(rbuf, rcount, dt, src, c->comm, (void *)stream));
  open = 0;
  MP_NCCL_CHECK(st, N.GroupEnd());
  return MP_OK;
fail:
  if (open) (void)N.GroupEnd(); /* keep NCCL's group depth balanced */
  return st;
}

/* All-to-all-v as one group of sends and receives.
 * Layout: send buffer = nranks consecutive segments, segment j (scounts[j]
 * elements) goes to rank j; recv buffer = segment i (rcounts[i] elements)
 * from rank i. Offsets are prefix sums, e.g. scounts = {3, 0, 5} gives send
 * offsets {0, 3, 3}: rank 1 gets nothing and no NCCL call is made for it. */
static mp_status mp_nccl_all_to_all_v(mp_comm *c, const char *sbuf, const uint64_t *scounts, char *rbuf,
                                      const uint64_t *rcounts, int dt, uintptr_t stream) {
  mp_status st = MP_OK;
  int open = 0;
  const size_t es = mp_dt_size[dt];
  size_t soff = 0, roff = 0;
  MP_NCCL_CHECK(st, N.GroupStart());
  open = 1;
  for (int p = 0; p < c->nranks; p++) {
    if (scounts[p]) MP_NCCL_CHECK(st, N.Send(sbuf + soff * es, scounts[p], dt, p, c->comm, (void *)stream));
    if (rcounts[p]) MP_NCCL_CHECK(st, N.Recv(rbuf + roff * es, rcounts[p], dt, p, c->comm, (void *)stream));
    soff += scounts[p];
    roff += rcounts[p];
  }
  open = 0;
  MP_NCCL_CHECK(st, N.GroupEnd());
  return MP_OK;
fail:
  if (open) (void)N.GroupEnd();
  return st;
}

static mp_status mp_nccl_all_reduce(mp_comm *c, const void *sbuf, void *rbuf, size_t count, int dt, int op,
                                    uintptr_t stream) {
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, N.AllReduce(sbuf, rbuf, count, dt, op, c->comm, (void *)stream));
fail:
  return st;
}

/* rbuf = nranks blocks of `count` elements, block r from rank r. */
static mp_status mp_nccl_all_gather(mp_comm *c, const void *sbuf, void *rbuf, size_t count, int dt,
                                    uintptr_t stream) {
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, N.AllGather(sbuf, rbuf, count, dt, c->comm, (void *)stream));
fail:
  return st;
}


/* ===========================================================================
 * Python bindings. Pointers, streams and communicator handles are ints;
 * counts are element counts of the given dtype code (NCCL's ncclDataType_t
 * values: int8 0, uint8 1, int32 2, uint32 3, int64 4, uint64 5, float16 6,
 * float32 7, float64 8, bfloat16 9). Every argument is checked before NCCL is
 * called; a bad one raises ValueError/TypeError naming it.
 * =========================================================================*/

/* Run an mp_status expression with the GIL released; raise on failure. */
#define MP_NOGIL_OR_RAISE(expr)                                        \
  do {                                                                 \
    mp_status st_;                                                     \
    Py_BEGIN_ALLOW_THREADS st_ = (expr);                               \
    Py_END_ALLOW_THREADS if (st_ != MP_OK) return mp_raise_status(st_); \
  } while (0)

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
  if (dt < 0 || dt >= MP_DT_COUNT) {
    PyErr_Format(PyExc_ValueError, "moepeak: dtype code must be an NCCL data type in [0, %d), got %d",
                 MP_DT_COUNT, dt);
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
  return Py_BuildValue("(is)", N.version, N.path);
}

/* nccl_loaded() -> (version, how_found) or None; never tries to load. */
static PyObject *py_nccl_loaded(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (!N.lib) Py_RETURN_NONE;
  return Py_BuildValue("(is)", N.version, N.path);
}

static PyObject *py_nccl_get_unique_id(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (mp_need_lib() < 0) return NULL;
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  mp_status st = MP_OK;
  Py_BEGIN_ALLOW_THREADS
  ncclResult_t r = N.GetUniqueId(&id);
  if (r != ncclSuccess) {
    mp_set_error(__FILE__, __LINE__, "ncclGetUniqueId failed: %s (ncclResult %d)", N.GetErrorString(r), r);
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
  Py_BEGIN_ALLOW_THREADS st = mp_nccl_comm_init(&id, nranks, rank, device, &c->comm);
  Py_END_ALLOW_THREADS
  if (st != MP_OK) {
    mp_raise_status(st);
    goto fail;
  }
  if (mp_comm_register(c) < 0) {
    (void)N.CommAbort(c->comm);
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
  Py_BEGIN_ALLOW_THREADS r = abort_ ? N.CommAbort(comm) : N.CommDestroy(comm);
  Py_END_ALLOW_THREADS
  if (r != ncclSuccess) {
    mp_set_error(__FILE__, __LINE__, "%s failed: %s (ncclResult %d)", abort_ ? "ncclCommAbort" : "ncclCommDestroy",
                 N.GetErrorString(r), r);
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
  ncclResult_t r = N.CommGetAsyncError(c->comm, &a);
  if (r != ncclSuccess) a = r;
  return Py_BuildValue("(is)", a, N.GetErrorString(a));
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
  MP_NCCL_CHECK(st, N.GroupStart());
  Py_RETURN_NONE;
fail:
  return mp_raise_status(st);
}

static mp_status mp_nccl_group_end(void) {
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, N.GroupEnd());
fail:
  return st;
}

static PyObject *py_nccl_group_end(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  if (mp_need_lib() < 0) return NULL;
  MP_NOGIL_OR_RAISE(mp_nccl_group_end());
  Py_RETURN_NONE;
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
  if (is_send) MP_NCCL_CHECK(st, N.Send((const void *)ptr, count, dt, peer, c->comm, (void *)stream));
  else MP_NCCL_CHECK(st, N.Recv((void *)ptr, count, dt, peer, c->comm, (void *)stream));
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
  MP_NOGIL_OR_RAISE(mp_nccl_send_recv(c, (const void *)sptr, scount, dst, (void *)rptr, rcount, src, dt, stream));
  Py_RETURN_NONE;
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
  Py_BEGIN_ALLOW_THREADS st = mp_nccl_all_to_all_v(c, (const char *)sptr, sc, (char *)rptr, rc, dt, stream);
  Py_END_ALLOW_THREADS
  if (st != MP_OK) {
    mp_raise_status(st);
    goto done;
  }
  ret = Py_None;
  Py_INCREF(ret);
done:
  free(counts);
  return ret;
}

/* nccl_all_reduce(comm, send_ptr, recv_ptr, count, dtype, op, stream); op: sum 0, prod 1, max 2, min 3.
 * send_ptr == recv_ptr is the in-place form. */
static PyObject *py_nccl_all_reduce(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h, *spo, *rpo, *co, *so;
  int dt, op;
  if (!PyArg_ParseTuple(args, "OOOOiiO:nccl_all_reduce", &h, &spo, &rpo, &co, &dt, &op, &so)) return NULL;
  mp_comm *c = mp_arg_comm(h);
  uint64_t count;
  uintptr_t sptr, rptr, stream;
  if (!c || mp_arg_count(co, "count", &count) < 0 || mp_arg_ptr(spo, "send_ptr", count, &sptr) < 0 ||
      mp_arg_ptr(rpo, "recv_ptr", count, &rptr) < 0 || mp_arg_dtype(dt) < 0 || mp_arg_ptr(so, "stream", 0, &stream) < 0)
    return NULL;
  if (op < 0 || op >= MP_OP_COUNT) {
    PyErr_Format(PyExc_ValueError, "moepeak: op code must be in [0, %d) (sum, prod, max, min), got %d", MP_OP_COUNT, op);
    return NULL;
  }
  MP_NOGIL_OR_RAISE(mp_nccl_all_reduce(c, (const void *)sptr, (void *)rptr, count, dt, op, stream));
  Py_RETURN_NONE;
}

/* nccl_all_gather(comm, send_ptr, recv_ptr, count, dtype, stream): count = elements per rank. */
static PyObject *py_nccl_all_gather(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *h, *spo, *rpo, *co, *so;
  int dt;
  if (!PyArg_ParseTuple(args, "OOOOiO:nccl_all_gather", &h, &spo, &rpo, &co, &dt, &so)) return NULL;
  mp_comm *c = mp_arg_comm(h);
  uint64_t count;
  uintptr_t sptr, rptr, stream;
  if (!c || mp_arg_count(co, "count", &count) < 0 || mp_arg_ptr(spo, "send_ptr", count, &sptr) < 0 ||
      mp_arg_ptr(rpo, "recv_ptr", count, &rptr) < 0 || mp_arg_dtype(dt) < 0 || mp_arg_ptr(so, "stream", 0, &stream) < 0)
    return NULL;
  MP_NOGIL_OR_RAISE(mp_nccl_all_gather(c, (const void *)sptr, (void *)rptr, count, dt, stream));
  Py_RETURN_NONE;
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
