/* mp_nccl.h: what csrc/nccl.c (the NCCL library layer) and csrc/nccl_bind.c
 * (its Python bindings) share: the slice of nccl.h moepeak uses, declared
 * here from NCCL's stable public ABI, the dlopen'ed function table, the
 * communicator handle and the library-layer functions (each returns an
 * mp_status and records "file:line: message"; see csrc/nccl.c). */
#ifndef MP_NCCL_H
#define MP_NCCL_H

#include "moepeak.h"

/* ---- the slice of nccl.h we use (public ABI) ---------------------------- */
typedef struct mp_ncclComm *ncclComm_t;
#define MP_NCCL_UNIQUE_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */
typedef struct { char internal[MP_NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
typedef int ncclResult_t; /* ncclSuccess = 0, ncclInProgress = 7 */
enum { ncclSuccess = 0, ncclInProgress = 7 };
/* ncclDataType_t and ncclRedOp_t: mp_nccl_dtype and mp_nccl_op of mp_abi.h (NCCL's values). */

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

extern mp_nccl_lib mp_nccl; /* mp_nccl.lib != NULL once loaded; guarded by the GIL */

/* Record the failed call, NCCL's error string and its last detailed message.
 * `call` is always mp_nccl.<Name>(...); "nccl" + (#call + 2) prints ncclName(...). */
#define MP_NCCL_CHECK(status_var, call)                                                       \
  do {                                                                                        \
    ncclResult_t r_ = (call);                                                                 \
    if (r_ != ncclSuccess) {                                                                  \
      const char *last_ = mp_nccl.GetLastError ? mp_nccl.GetLastError(NULL) : NULL;                       \
      MP_FAIL(status_var, MP_ERR_NCCL, "nccl%s failed: %s (ncclResult %d)%s%s", #call + 8,            \
              mp_nccl.GetErrorString ? mp_nccl.GetErrorString(r_) : "?", r_,                              \
              (last_ && last_[0]) ? "; NCCL says: " : "", (last_ && last_[0]) ? last_ : "");  \
    }                                                                                         \
  } while (0)

/* A communicator handle as Python sees it (an int holding this pointer). */
typedef struct {
  ncclComm_t comm;
  int nranks, rank, device; /* device -1: the thread's current device at init */
} mp_comm;

#define MP_MAX_COMMS 256 /* live communicators at once: far above any sane use */
mp_status mp_nccl_load(const char *path); /* idempotent once it succeeds */
int mp_comm_register(mp_comm *c);         /* -1 when the table is full */
void mp_comm_unregister(mp_comm *c);
mp_comm *mp_comm_lookup(unsigned long long handle); /* NULL unless live */
mp_status mp_nccl_comm_init(const ncclUniqueId *id, int nranks, int rank, int device, ncclComm_t *out);
mp_status mp_nccl_send_recv(mp_comm *c, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                            int src, int dt, uintptr_t stream);
mp_status mp_nccl_all_to_all_v(mp_comm *c, const char *sbuf, const uint64_t *scounts, char *rbuf,
                               const uint64_t *rcounts, int dt, uintptr_t stream);
mp_status mp_nccl_all_reduce(mp_comm *c, const void *sbuf, void *rbuf, size_t count, int dt, int op,
                             uintptr_t stream);
mp_status mp_nccl_all_gather(mp_comm *c, const void *sbuf, void *rbuf, size_t count, int dt, uintptr_t stream);
mp_status mp_nccl_group_end(void);

#endif /* MP_NCCL_H */
