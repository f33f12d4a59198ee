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
 * Layer split: the mp_nccl_* functions here return an mp_status and record
 * "file:line: message"; only the bindings (csrc/nccl_bind.c) raise Python
 * exceptions, after validating every argument (so bad input never reaches
 * NCCL). Shared declarations: csrc/mp_nccl.h.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mp_nccl.h"

mp_nccl_lib mp_nccl;
/* Element size of each ncclDataType_t code (mp_nccl_dtype, mp_abi.h). */
static const size_t mp_dt_size[MP_NCCL_DTYPE_COUNT] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};

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
  mp_nccl = t;
fail:
  return st;
}

/* Load libnccl once (the first success sticks). `path` may be NULL. */
mp_status mp_nccl_load(const char *path) {
  mp_status st = MP_OK;
  if (mp_nccl.lib) return MP_OK;
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

static mp_comm *mp_live[MP_MAX_COMMS];

int mp_comm_register(mp_comm *c) {
  for (int i = 0; i < MP_MAX_COMMS; i++)
    if (!mp_live[i]) { mp_live[i] = c; return 0; }
  return -1;
}
void mp_comm_unregister(mp_comm *c) {
  for (int i = 0; i < MP_MAX_COMMS; i++)
    if (mp_live[i] == c) mp_live[i] = NULL;
}
mp_comm *mp_comm_lookup(unsigned long long h) {
  for (int i = 0; i < MP_MAX_COMMS; i++)
    if (h && (uintptr_t)mp_live[i] == (uintptr_t)h) return mp_live[i];
  return NULL;
}

/* Blocks until all `nranks` ranks have called it with the same id. */
mp_status mp_nccl_comm_init(const ncclUniqueId *id, int nranks, int rank, int device, ncclComm_t *out) {
  mp_status st = MP_OK;
  *out = NULL;
#if MP_WITH_CUDA
  /* NCCL binds the communicator to the calling thread's current device. */
  if (device >= 0) MP_TRY(st, mp_cu_set_device(device));
#else
  (void)device;
#endif
  MP_NCCL_CHECK(st, mp_nccl.CommInitRank(out, nranks, *id, rank));
fail:
  return st;
}

/* ---- operations ---------------------------------------------------------- *
 * `stream` is a cudaStream_t as an int; counts are in elements of `dt`. */

/* One grouped pair: send `scount` elements to `dst`, receive `rcount` from
 * `src` (either count may be 0: that half is skipped; the peer skips it too
 * because counts agree pairwise). */
mp_status mp_nccl_send_recv(mp_comm *c, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                                   int src, int dt, uintptr_t stream) {
  mp_status st = MP_OK;
  int open = 0;
  MP_NCCL_CHECK(st, mp_nccl.GroupStart());
  open = 1;
  if (scount) MP_NCCL_CHECK(st, mp_nccl.Send(sbuf, scount, dt, dst, c->comm, (void *)stream));
  if (rcount) MP_NCCL_CHECK(st, mp_nccl.Recv(rbuf, rcount, dt, src, c->comm, (void *)stream));
  open = 0;
  MP_NCCL_CHECK(st, mp_nccl.GroupEnd());
  return MP_OK;
fail:
  if (open) (void)mp_nccl.GroupEnd(); /* keep NCCL's group depth balanced */
  return st;
}

/* All-to-all-v as one group of sends and receives.
 * Layout: send buffer = nranks consecutive segments, segment j (scounts[j]
 * elements) goes to rank j; recv buffer = segment i (rcounts[i] elements)
 * from rank i. Offsets are prefix sums, e.g. scounts = {3, 0, 5} gives send
 * offsets {0, 3, 3}: rank 1 gets nothing and no NCCL call is made for it. */
mp_status mp_nccl_all_to_all_v(mp_comm *c, const char *sbuf, const uint64_t *scounts, char *rbuf,
                                      const uint64_t *rcounts, int dt, uintptr_t stream) {
  mp_status st = MP_OK;
  int open = 0;
  const size_t es = mp_dt_size[dt];
  size_t soff = 0, roff = 0;
  MP_NCCL_CHECK(st, mp_nccl.GroupStart());
  open = 1;
  for (int p = 0; p < c->nranks; p++) {
    if (scounts[p]) MP_NCCL_CHECK(st, mp_nccl.Send(sbuf + soff * es, scounts[p], dt, p, c->comm, (void *)stream));
    if (rcounts[p]) MP_NCCL_CHECK(st, mp_nccl.Recv(rbuf + roff * es, rcounts[p], dt, p, c->comm, (void *)stream));
    soff += scounts[p];
    roff += rcounts[p];
  }
  open = 0;
  MP_NCCL_CHECK(st, mp_nccl.GroupEnd());
  return MP_OK;
fail:
  if (open) (void)mp_nccl.GroupEnd();
  return st;
}

mp_status mp_nccl_all_reduce(mp_comm *c, const void *sbuf, void *rbuf, size_t count, int dt, int op,
                                    uintptr_t stream) {
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, mp_nccl.AllReduce(sbuf, rbuf, count, dt, op, c->comm, (void *)stream));
fail:
  return st;
}

/* rbuf = nranks blocks of `count` elements, block r from rank r. */
mp_status mp_nccl_all_gather(mp_comm *c, const void *sbuf, void *rbuf, size_t count, int dt,
                                    uintptr_t stream) {
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, mp_nccl.AllGather(sbuf, rbuf, count, dt, c->comm, (void *)stream));
fail:
  return st;
}


mp_status mp_nccl_group_end(void) {
  mp_status st = MP_OK;
  MP_NCCL_CHECK(st, mp_nccl.GroupEnd());
fail:
  return st;
}

