/* sco.c: SCO (selective checkpoint offload): the pinned arena and the copy
 * engine for checkpoint boundaries.
 *
 * What lives here (the Python schedule in moepeak/sco/checkpoint.py decides *when*):
 *  - sco_arena_alloc(nbytes) / sco_arena_free(ptr): one page-locked host chunk
 *    per call (cudaHostAlloc, portable). The arena is a handful of such
 *    chunks allocated once and reused for every iteration; there is no
 *    per-tensor pinning (first pinning costs about 1 s/GiB, and torch's caching
 *    host allocator rounds each request up to a power of two).
 *  - sco_copy(dst, src, nbytes, stream, wait_event, done_event): the one
 *    ordered copy the engine issues, D2H (offload) or H2D (reload):
 *        stream waits on wait_event  (the producer of src / the last reader of dst)
 *        cudaMemcpyAsync(dst, src, nbytes) on stream
 *        done_event recorded on stream (consumers wait on it; the source
 *                                       tensor is kept alive until it completes)
 *    All three are enqueued under one call so no other thread's work can slip
 *    between the wait and the copy on that stream.
 * Pointers, streams and events are Python ints (uintptr_t). In a CPU-only
 * build every entry point raises a clear RuntimeError; the schedule never
 * calls them for CPU tensors (there is nothing to copy). */
#include <stdio.h>

#include "mp_python.h"

#if MP_WITH_CUDA
/* Enqueue wait -> copy -> record on `stream`. 0 for wait_event / done_event
 * means "none". */
static mp_status sco_copy_impl(void *dst, const void *src, size_t nbytes, uintptr_t stream,
                               uintptr_t wait_event, uintptr_t done_event) {
  mp_status st = MP_OK;
  if (wait_event) MP_TRY(st, mp_cu_stream_wait_event(stream, wait_event));
  MP_TRY(st, mp_cu_memcpy_async(dst, src, nbytes, stream));
  if (done_event) MP_TRY(st, mp_cu_event_record(done_event, stream));
fail:
  return st;
}
#endif

#if MP_WITH_CUDA
/* One pinned arena chunk; a refusal becomes MP_ERR_NOMEM (MemoryError) with
 * SCO's advice and the driver's message. mp_cu_host_alloc has already cleared
 * the non-sticky CUDA error a refused cudaHostAlloc leaves behind. */
static mp_status sco_host_alloc(void **ptr, long long n) {
  mp_status st = mp_cu_host_alloc(ptr, (size_t)n);
  if (st == MP_OK && *ptr != NULL) return MP_OK;
  char cause[512];
  snprintf(cause, sizeof cause, "%s", mp_last_error());
  mp_set_error(__FILE__, __LINE__,
               "SCO could not allocate %lld bytes (%.2f GiB) of pinned host memory for its arena (%s); lower "
               "the depth x sequence offloaded, set SCOConfig(arena_bytes=...) smaller, or free host RAM",
               n, (double)n / (double)(1ull << 30), cause);
  return MP_ERR_NOMEM;
}
#endif

#if !MP_WITH_CUDA
#define sco_host_alloc NULL
#endif

/* sco_arena_alloc(nbytes) -> ptr (pinned). MemoryError naming the size when
 * the driver refuses. */
static PyObject *py_sco_arena_alloc(PyObject *self, PyObject *arg) {
  (void)self;
  return mp_py_pinned_alloc(arg, "SCO arena", "SCO pinned arena (sco_arena_alloc)", sco_host_alloc);
}

static PyObject *py_sco_arena_free(PyObject *self, PyObject *arg) {
  (void)self;
  return mp_py_pinned_free(arg, "SCO pinned arena (sco_arena_free)");
}

/* sco_copy(dst, src, nbytes, stream, wait_event, done_event) */
static PyObject *py_sco_copy(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long dst, src, n, stream, wait_ev, done_ev;
  if (!PyArg_ParseTuple(args, "KKKKKK:sco_copy", &dst, &src, &n, &stream, &wait_ev, &done_ev)) return NULL;
  if (n > 0 && (dst == 0 || src == 0)) {
    PyErr_SetString(PyExc_ValueError, "moepeak: sco_copy got a null dst or src pointer");
    return NULL;
  }
#if MP_WITH_CUDA
  return mp_return_none(sco_copy_impl((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n,
                               (uintptr_t)stream, (uintptr_t)wait_ev, (uintptr_t)done_ev));
#else
  (void)stream;
  (void)wait_ev;
  (void)done_ev;
  return mp_raise_no_cuda("SCO copy engine (sco_copy)");
#endif
}

PyMethodDef mp_sco_methods[] = {
    {"sco_arena_alloc", py_sco_arena_alloc, METH_O, "sco_arena_alloc(nbytes) -> ptr: one pinned arena chunk."},
    {"sco_arena_free", py_sco_arena_free, METH_O, "sco_arena_free(ptr)"},
    {"sco_copy", py_sco_copy, METH_VARARGS,
     "sco_copy(dst, src, nbytes, stream, wait_event, done_event): stream waits on wait_event (0: none), "
     "copies nbytes asynchronously, records done_event (0: none)."},
    {NULL, NULL, 0, NULL},
};
