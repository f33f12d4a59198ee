/* spill.c: the disk tier's spill file and its I/O threads (contract: spill.h).
 *
 * Invariants (all guarded by f->mu):
 *  - req[s] is free iff req[s].ticket == 0; free slots are on free_slot[0..nfree).
 *    A ticket is seq * MP_SPILL_MAX_TICKETS + s with seq >= 1, so a stale ticket
 *    (released, its slot reused) never matches the slot's current one.
 *  - A request is in flight from submit until its last chunk finishes
 *    (chunks_left == 0), then done until waited on; `in_flight` counts the
 *    former. queue[] (a ring of slots) holds the in-flight requests with chunks
 *    not yet handed out (next_chunk < nchunks), oldest first.
 *  - Workers sleep on work_cv; waiters and close sleep on done_cv, broadcast
 *    whenever a request completes. close sets `closing` (no new request), waits
 *    for in_flight == 0, then `stop`s and joins the workers: so no worker ever
 *    touches a caller's buffer after close returns.
 * Worked example, MP_SPILL_CHUNK = 8 MiB, a write of 20 MiB + 100 B under O_DIRECT:
 * 3 chunks (8, 8, 4 MiB + 100 B); the third writes 4 MiB directly, then its last
 * 100 B through the bounce block as one 4096-byte pwrite (4 MiB + 4 KiB in all). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "spill.h"

enum { REQ_FREE = 0, REQ_IN_FLIGHT = 1, REQ_DONE = 2 };

typedef struct {
  int64_t ticket; /* 0: free slot */
  int state;      /* REQ_* */
  int is_write;
  char *buf;
  int64_t nbytes, offset;
  int64_t nchunks, next_chunk, chunks_left;
  int err;        /* first error (lowest err_at) among its chunks; 0: none */
  int64_t err_at;
} spill_req;

typedef struct {
  mp_spill *f;
  int index;
} worker_arg;

struct mp_spill {
  int fd, direct, nthreads, started;
  char *dir;
  pthread_mutex_t mu;
  pthread_cond_t work_cv, done_cv;
  int closing, closed, stop;
  pthread_t *thread;
  worker_arg *args;
  char **bounce;      /* [nbounce] one aligned MP_SPILL_ALIGN block per thread */
  int nbounce;
  spill_req req[MP_SPILL_MAX_TICKETS];
  int free_slot[MP_SPILL_MAX_TICKETS], nfree;
  int queue[MP_SPILL_MAX_TICKETS], qhead, qlen;
  int64_t seq, written_end;
  int in_flight;
};

static int64_t round_up(int64_t x) { return (x + MP_SPILL_ALIGN - 1) / MP_SPILL_ALIGN * MP_SPILL_ALIGN; }

/* pread/pwrite [buf, buf + len) at off until at least `need` bytes moved;
 * returns 0 or an errno with *at the offset of the failing call. EOF before
 * `need` is ENODATA; a write that moves 0 bytes is EIO. */
static int rw_full(int fd, int is_write, char *buf, int64_t len, int64_t off, int64_t need, int64_t *at) {
  int64_t done = 0;
  while (done < need) {
    ssize_t r = is_write ? pwrite(fd, buf + done, (size_t)(len - done), (off_t)(off + done))
                         : pread(fd, buf + done, (size_t)(len - done), (off_t)(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      *at = off + done;
      return r < 0 ? errno : (is_write ? EIO : ENODATA);
    }
    done += r;
  }
  return 0;
}

/* One chunk: bytes [b, e) of request q, run by the worker owning `bounce`. */
static int run_chunk(const mp_spill *f, const spill_req *q, int64_t b, int64_t e, char *bounce, int64_t *at) {
  char *buf = q->buf + b;
  int64_t off = q->offset + b, n = e - b;
  int64_t whole = f->direct ? n / MP_SPILL_ALIGN * MP_SPILL_ALIGN : n;
  int err = whole > 0 ? rw_full(f->fd, q->is_write, buf, whole, off, whole, at) : 0;
  if (err || whole == n) return err;
  int64_t tail = n - whole; /* O_DIRECT and a partial last block: stage it */
  if (q->is_write) {
    memcpy(bounce, buf + whole, (size_t)tail);
    memset(bounce + tail, 0, (size_t)(MP_SPILL_ALIGN - tail));
    return rw_full(f->fd, 1, bounce, MP_SPILL_ALIGN, off + whole, MP_SPILL_ALIGN, at);
  }
  err = rw_full(f->fd, 0, bounce, MP_SPILL_ALIGN, off + whole, tail, at);
  if (!err) memcpy(buf + whole, bounce, (size_t)tail);
  return err;
}

static void *worker_main(void *varg) {
  worker_arg *a = (worker_arg *)varg;
  mp_spill *f = a->f;
  pthread_mutex_lock(&f->mu);
  for (;;) {
    while (f->qlen == 0 && !f->stop) pthread_cond_wait(&f->work_cv, &f->mu);
    if (f->qlen == 0) break; /* stop, and nothing left (close waited for in_flight == 0) */
    int s = f->queue[f->qhead];
    spill_req *q = &f->req[s];
    int64_t k = q->next_chunk++;
    if (q->next_chunk == q->nchunks) {
      f->qhead = (f->qhead + 1) % MP_SPILL_MAX_TICKETS;
      f->qlen--;
    }
    int skip = q->err != 0; /* an earlier chunk failed: do not start more I/O for this request */
    pthread_mutex_unlock(&f->mu);
    int64_t b = k * MP_SPILL_CHUNK, e = b + MP_SPILL_CHUNK < q->nbytes ? b + MP_SPILL_CHUNK : q->nbytes;
    int64_t at = 0;
    int err = skip ? 0 : run_chunk(f, q, b, e, f->bounce[a->index], &at);
    pthread_mutex_lock(&f->mu);
    if (err && (q->err == 0 || at < q->err_at)) {
      q->err = err;
      q->err_at = at;
    }
    if (--q->chunks_left == 0) {
      q->state = REQ_DONE;
      f->in_flight--;
      pthread_cond_broadcast(&f->done_cv);
    }
  }
  pthread_mutex_unlock(&f->mu);
  return NULL;
}

/* A new file descriptor for an anonymous file in dir; -1 with errno set. */
static int open_anonymous(const char *dir, int use_tmpfile) {
  if (use_tmpfile) {
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR)) return fd; /* EISDIR: kernel without O_TMPFILE */
  }
  static unsigned counter = 0;
  size_t len = strlen(dir) + 64;
  char *path = (char *)malloc(len);
  if (!path) {
    errno = ENOMEM;
    return -1;
  }
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
    unsigned c = __atomic_fetch_add(&counter, 1u, __ATOMIC_RELAXED);
    snprintf(path, len, "%s/.moepeak-spill-%ld-%u-%d", dir, (long)getpid(), c, attempt);
    fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd >= 0 && unlink(path) != 0) { /* no name may outlive this call */
    int unlink_err = errno;
    close(fd);
    fd = -1;
    errno = unlink_err;
  }
  int e = errno;
  free(path);
  errno = e;
  return fd;
}

mp_status mp_spill_open(const char *dir, int64_t capacity, int threads, int direct, int use_tmpfile, mp_spill **out,
                        int *err) {
  mp_status st = MP_OK;
  mp_spill *f = NULL;
  *out = NULL;
  *err = 0;
  if (threads < 1 || threads > MP_SPILL_MAX_THREADS || capacity < 0)
    MP_FAIL(st, MP_ERR_INVALID, "spill: threads %d must be in [1, %d] and capacity %lld >= 0", threads,
            MP_SPILL_MAX_THREADS, (long long)capacity);
  f = (mp_spill *)calloc(1, sizeof *f);
  if (!f) MP_FAIL(st, MP_ERR_NOMEM, "spill: out of host memory");
  f->fd = -1;
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->work_cv, NULL);
  pthread_cond_init(&f->done_cv, NULL);
  f->dir = strdup(dir);
  f->thread = (pthread_t *)calloc((size_t)threads, sizeof(pthread_t));
  f->args = (worker_arg *)calloc((size_t)threads, sizeof(worker_arg));
  f->bounce = (char **)calloc((size_t)threads, sizeof(char *));
  if (!f->dir || !f->thread || !f->args || !f->bounce) MP_FAIL(st, MP_ERR_NOMEM, "spill: out of host memory");
  f->nbounce = threads;
  for (int t = 0; t < threads; t++)
    if (posix_memalign((void **)&f->bounce[t], MP_SPILL_ALIGN, MP_SPILL_ALIGN) != 0)
      MP_FAIL(st, MP_ERR_NOMEM, "spill: out of host memory");
  for (int s = 0; s < MP_SPILL_MAX_TICKETS; s++) f->free_slot[s] = MP_SPILL_MAX_TICKETS - 1 - s;
  f->nfree = MP_SPILL_MAX_TICKETS;

  f->fd = open_anonymous(dir, use_tmpfile);
  if (f->fd < 0) {
    *err = errno;
    MP_FAIL(st, MP_ERR_SYS, "cannot create a spill file in %s: %s", dir, strerror(*err));
  }
  if (direct != MP_SPILL_DIRECT_OFF) {
    int fl = fcntl(f->fd, F_GETFL);
    if (fl >= 0 && fcntl(f->fd, F_SETFL, fl | O_DIRECT) == 0) {
      f->direct = 1;
    } else if (direct == MP_SPILL_DIRECT_ON || errno != EINVAL) { /* EINVAL: this filesystem has no direct I/O */
      *err = errno;
      MP_FAIL(st, MP_ERR_SYS, "the filesystem of %s refuses O_DIRECT: %s", dir, strerror(*err));
    }
  }
  if (capacity > 0 && fallocate(f->fd, 0, 0, (off_t)capacity) != 0 && errno != EOPNOTSUPP) {
    *err = errno;
    MP_FAIL(st, MP_ERR_SYS, "cannot reserve %lld bytes for a spill file in %s: %s", (long long)capacity, dir,
            strerror(*err));
  }
  for (int t = 0; t < threads; t++) {
    f->args[t].f = f;
    f->args[t].index = t;
    int rc = pthread_create(&f->thread[t], NULL, worker_main, &f->args[t]);
    if (rc != 0) {
      *err = rc;
      MP_FAIL(st, MP_ERR_SYS, "spill: cannot start I/O thread %d of %d: %s", t + 1, threads, strerror(rc));
    }
    f->nthreads = t + 1;
  }
  *out = f;
  return MP_OK;
fail:
  mp_spill_free(f); /* joins the threads started, closes the file */
  return st;
}

int mp_spill_direct(const mp_spill *f) { return f->direct; }
const char *mp_spill_dir(const mp_spill *f) { return f->dir; }
int mp_spill_threads(const mp_spill *f) { return f->nthreads; }

int64_t mp_spill_written_end(mp_spill *f) {
  pthread_mutex_lock(&f->mu);
  int64_t w = f->written_end;
  pthread_mutex_unlock(&f->mu);
  return w;
}

int mp_spill_in_flight(mp_spill *f) {
  pthread_mutex_lock(&f->mu);
  int n = f->in_flight;
  pthread_mutex_unlock(&f->mu);
  return n;
}

/* The held request `ticket` names, or NULL (message set). Called under mu.
 * Tickets stay valid after close (their requests are done): a thread that
 * raced with close still collects its result. */
static spill_req *find_req(mp_spill *f, int64_t ticket) {
  int64_t s = ticket > 0 ? ticket % MP_SPILL_MAX_TICKETS : -1;
  if (s < 0 || f->req[s].ticket != ticket) {
    mp_set_error(__FILE__, __LINE__, "spill ticket %lld is unknown (never issued, or already waited on)",
                 (long long)ticket);
    return NULL;
  }
  return &f->req[s];
}

mp_status mp_spill_submit(mp_spill *f, int is_write, void *buf, int64_t nbytes, int64_t offset, int64_t *ticket) {
  mp_status st = MP_OK;
  const char *what = is_write ? "write" : "read";
  pthread_mutex_lock(&f->mu);
  if (f->closing) MP_FAIL(st, MP_ERR_INVALID, "spill file in %s is closed", f->dir);
  if (nbytes <= 0 || offset < 0 || offset % MP_SPILL_ALIGN || (uintptr_t)buf % MP_SPILL_ALIGN ||
      offset > INT64_MAX - MP_SPILL_ALIGN - nbytes)
    MP_FAIL(st, MP_ERR_INVALID, "spill %s of %lld bytes at offset %lld from %p is misaligned or out of range", what,
            (long long)nbytes, (long long)offset, buf);
  int64_t end = offset + nbytes, extent_end = round_up(end);
  if (!is_write && end > f->written_end)
    MP_FAIL(st, MP_ERR_INVALID, "spill read of bytes [%lld, %lld) reaches past the %lld bytes written to the file",
            (long long)offset, (long long)end, (long long)f->written_end);
  for (int s = 0; s < MP_SPILL_MAX_TICKETS; s++) {
    const spill_req *q = &f->req[s];
    if (q->state != REQ_IN_FLIGHT || !(is_write || q->is_write)) continue;
    if (offset < round_up(q->offset + q->nbytes) && q->offset < extent_end)
      MP_FAIL(st, MP_ERR_INVALID, "spill %s of bytes [%lld, %lld) overlaps the in-flight %s of [%lld, %lld) "
              "(ticket %lld): wait on it first", what, (long long)offset, (long long)end,
              q->is_write ? "write" : "read", (long long)q->offset, (long long)(q->offset + q->nbytes),
              (long long)q->ticket);
  }
  if (f->nfree == 0)
    MP_FAIL(st, MP_ERR_INVALID, "%d spill tickets are held (in flight or not yet waited on): wait on some first",
            MP_SPILL_MAX_TICKETS);
  int s = f->free_slot[--f->nfree];
  spill_req *q = &f->req[s];
  memset(q, 0, sizeof *q);
  q->ticket = ++f->seq * MP_SPILL_MAX_TICKETS + s;
  q->state = REQ_IN_FLIGHT;
  q->is_write = is_write;
  q->buf = (char *)buf;
  q->nbytes = nbytes;
  q->offset = offset;
  q->nchunks = q->chunks_left = (nbytes + MP_SPILL_CHUNK - 1) / MP_SPILL_CHUNK;
  f->queue[(f->qhead + f->qlen) % MP_SPILL_MAX_TICKETS] = s; /* qlen < MAX: one entry per in-flight slot */
  f->qlen++;
  f->in_flight++;
  if (is_write && end > f->written_end) f->written_end = end;
  *ticket = q->ticket;
  pthread_cond_broadcast(&f->work_cv);
fail:
  pthread_mutex_unlock(&f->mu);
  return st;
}

mp_status mp_spill_poll(mp_spill *f, int64_t ticket, int *done) {
  mp_status st = MP_OK;
  pthread_mutex_lock(&f->mu);
  const spill_req *q = find_req(f, ticket);
  if (!q) st = MP_ERR_INVALID;
  else *done = q->state == REQ_DONE;
  pthread_mutex_unlock(&f->mu);
  return st;
}

mp_status mp_spill_wait(mp_spill *f, int64_t ticket, mp_spill_error *e) {
  mp_status st = MP_OK;
  memset(e, 0, sizeof *e);
  pthread_mutex_lock(&f->mu);
  spill_req *q = find_req(f, ticket);
  if (!q) {
    st = MP_ERR_INVALID; /* find_req set the message */
    goto fail;
  }
  while (q->state != REQ_DONE) pthread_cond_wait(&f->done_cv, &f->mu);
  if (q->ticket != ticket) /* another thread waited on it meanwhile and released it */
    MP_FAIL(st, MP_ERR_INVALID, "spill ticket %lld was waited on by another thread", (long long)ticket);
  if (q->err) {
    e->err = q->err;
    e->is_write = q->is_write;
    e->offset = q->offset;
    e->nbytes = q->nbytes;
    e->at = q->err_at;
    mp_set_error(__FILE__, __LINE__, "spill %s of bytes [%lld, %lld) failed at byte %lld: %s",
                 q->is_write ? "write" : "read", (long long)q->offset, (long long)(q->offset + q->nbytes),
                 (long long)q->err_at, strerror(q->err));
    st = MP_ERR_SYS;
  }
  q->ticket = 0;
  q->state = REQ_FREE;
  f->free_slot[f->nfree++] = (int)(q - f->req);
fail:
  pthread_mutex_unlock(&f->mu);
  return st;
}

mp_status mp_spill_close(mp_spill *f) {
  if (!f) return MP_OK;
  pthread_mutex_lock(&f->mu);
  if (f->closing) { /* closed, or being closed by another thread: wait for that */
    while (!f->closed) pthread_cond_wait(&f->done_cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    return MP_OK;
  }
  f->closing = 1;
  while (f->in_flight > 0) pthread_cond_wait(&f->done_cv, &f->mu);
  f->stop = 1;
  pthread_cond_broadcast(&f->work_cv);
  pthread_mutex_unlock(&f->mu);
  for (int t = 0; t < f->nthreads; t++) pthread_join(f->thread[t], NULL);
  if (f->fd >= 0) close(f->fd);
  pthread_mutex_lock(&f->mu);
  f->fd = -1;
  f->nthreads = 0;
  f->closed = 1;
  pthread_cond_broadcast(&f->done_cv);
  pthread_mutex_unlock(&f->mu);
  return MP_OK;
}

void mp_spill_free(mp_spill *f) {
  if (!f) return;
  mp_spill_close(f);
  for (int t = 0; f->bounce && t < f->nbounce; t++) free(f->bounce[t]);
  free(f->bounce);
  free(f->args);
  free(f->thread);
  free(f->dir);
  pthread_cond_destroy(&f->work_cv);
  pthread_cond_destroy(&f->done_cv);
  pthread_mutex_destroy(&f->mu);
  free(f);
}
