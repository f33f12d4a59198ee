/* fake_nccl.c: a stand-in libnccl for CPU tests of csrc/nccl.c (test-only).
 *
 * It exports the NCCL symbols moepeak dlsym's, working on host memory, so the
 * C transport's loading, argument passing, grouping and offset arithmetic can
 * be checked on a machine with no GPU. Semantics ("loopback peers"): a
 * communicator of any size lives in one process; whatever is sent to peer p
 * inside a group comes back as the data received from peer p (each peer
 * echoes), so an all-to-all-v with send_counts == recv_counts returns its
 * input, segment by segment. Sends and receives must pair up per peer with
 * equal byte counts or ncclGroupEnd fails (ncclInvalidUsage), as a hang
 * would on real NCCL. A count of exactly 12345 elements fails with
 * ncclInvalidArgument (to test error reporting). fake_nccl_calls() counts
 * every entry point call, so tests can check that bad arguments never
 * reached the library; FAKE_NCCL_SLOW_DESTROY makes ncclCommDestroy take 3 s.
 * Built by tests/test_transport.py with `cc -shared`. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct { int nranks, rank; } fake_comm;
typedef fake_comm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
enum { ok = 0, invalid_argument = 4, invalid_usage = 5 };
static const size_t dt_size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};

#define MAXQ 1024
typedef struct { char *buf; size_t bytes; int peer; } op_t;
static op_t sends[MAXQ], recvs[MAXQ];
static int nsend, nrecv, depth;
static long calls;
static char last[256];

long fake_nccl_calls(void) { return calls; }
int ncclGetVersion(int *v) { calls++; *v = 29901; return ok; }
const char *ncclGetErrorString(int r) {
  return r == ok ? "no error" : r == invalid_argument ? "invalid argument (fake)" : "invalid usage (fake)";
}
const char *ncclGetLastError(ncclComm_t c) { (void)c; return last; }
int ncclGetUniqueId(ncclUniqueId *id) { calls++; memset(id->internal, 0x5a, sizeof id->internal); return ok; }
int ncclCommInitRank(ncclComm_t *c, int nranks, ncclUniqueId id, int rank) {
  calls++;
  for (int i = 0; i < 128; i++)
    if (id.internal[i] != 0x5a) { strcpy(last, "unique id corrupted"); return invalid_argument; }
  *c = calloc(1, sizeof **c);
  (*c)->nranks = nranks;
  (*c)->rank = rank;
  return ok;
}
/* With FAKE_NCCL_SLOW_DESTROY set, destroy takes 3 s (a peer that is late). */
int ncclCommDestroy(ncclComm_t c) {
  calls++;
  if (getenv("FAKE_NCCL_SLOW_DESTROY")) sleep(3);
  free(c);
  return ok;
}
int ncclCommAbort(ncclComm_t c) { calls++; free(c); return ok; }
int ncclCommGetAsyncError(ncclComm_t c, int *e) { (void)c; calls++; *e = ok; return ok; }
int ncclGroupStart(void) { calls++; depth++; return ok; }
int ncclGroupEnd(void) {
  calls++;
  if (depth <= 0) return invalid_usage;
  if (--depth) return ok;
  int rc = ok;
  /* The k-th send to peer p pairs with the k-th receive from peer p. */
  for (int i = 0; i < nrecv && rc == ok; i++) {
    int k = 0, j;
    for (j = 0; j < i; j++) k += recvs[j].peer == recvs[i].peer;
    for (j = 0; j < nsend; j++)
      if (sends[j].peer == recvs[i].peer && k-- == 0) break;
    if (j == nsend || sends[j].bytes != recvs[i].bytes) { strcpy(last, "unmatched send/recv"); rc = invalid_usage; }
    else memcpy(recvs[i].buf, sends[j].buf, sends[j].bytes);
  }
  if (rc == ok && nsend != nrecv) { strcpy(last, "unmatched send/recv"); rc = invalid_usage; }
  nsend = nrecv = 0;
  return rc;
}
static int queue(op_t *q, int *n, const void *buf, size_t count, int dt, int peer, ncclComm_t c) {
  calls++;
  if (count == 12345) { strcpy(last, "count 12345 refused by the fake"); return invalid_argument; }
  if (!depth || *n >= MAXQ || peer < 0 || peer >= c->nranks) { strcpy(last, "p2p outside a group"); return invalid_usage; }
  q[*n].buf = (char *)buf;
  q[*n].bytes = count * dt_size[dt];
  q[*n].peer = peer;
  ++*n;
  return ok;
}
int ncclSend(const void *b, size_t n, int dt, int peer, ncclComm_t c, void *s) { (void)s; return queue(sends, &nsend, b, n, dt, peer, c); }
int ncclRecv(void *b, size_t n, int dt, int peer, ncclComm_t c, void *s) { (void)s; return queue(recvs, &nrecv, b, n, dt, peer, c); }
/* Every peer holds the same data: sum = nranks * x, max = min = x. */
int ncclAllReduce(const void *sb, void *rb, size_t n, int dt, int op, ncclComm_t c, void *s) {
  (void)s;
  calls++;
  if (c->nranks == 1) { memmove(rb, sb, n * dt_size[dt]); return ok; } /* one rank: identity for every op */
  if (dt != 7) { strcpy(last, "fake all-reduce is float32 only"); return invalid_argument; }
  for (size_t i = 0; i < n; i++) ((float *)rb)[i] = ((const float *)sb)[i] * (op == 0 ? (float)c->nranks : 1.0f);
  return ok;
}
int ncclAllGather(const void *sb, void *rb, size_t n, int dt, ncclComm_t c, void *s) {
  (void)s;
  calls++;
  for (int r = 0; r < c->nranks; r++) memmove((char *)rb + (size_t)r * n * dt_size[dt], sb, n * dt_size[dt]);
  return ok;
}
