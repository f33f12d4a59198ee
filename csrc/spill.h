/* spill.h: the disk tier: an anonymous spill file and asynchronous reads and
 * writes of byte ranges between it and caller-owned (pinned) host buffers
 * (spill.c; Python binding in spill_bind.c).
 *
 * The file: created in a given directory with O_TMPFILE (no name, ever), or,
 * where the filesystem lacks O_TMPFILE, created under a unique name and
 * unlinked before mp_spill_open returns, so a crash leaves nothing behind and
 * the space is freed when the descriptor closes. O_DIRECT is turned on where
 * the filesystem accepts it (no page-cache copy, no cache pollution: the
 * caller's buffers are the cache); where it refuses (ramfs, some FUSE or
 * network filesystems) I/O is buffered and mp_spill_direct() says so.
 * `capacity` bytes are reserved up front with fallocate() where supported, so
 * a disk too small fails at open and not mid-run; writes may go past it.
 *
 * Requests (write: buffer -> file; read: file -> buffer):
 *  - buffer address and file offset are multiples of MP_SPILL_ALIGN (4096);
 *    nbytes is any count > 0. Under O_DIRECT the last partial 4096-byte block
 *    of a request goes through a per-thread aligned bounce block: the caller's
 *    memory past buffer + nbytes is never read or written, and a write fills
 *    the file up to the next 4096 boundary (zeros), which no other request can
 *    own since every request starts on a boundary. So a request's extent is
 *    [offset, round_up(offset + nbytes, 4096)).
 *  - each is split into chunks of MP_SPILL_CHUNK bytes run by the file's own
 *    I/O threads (pread/pwrite, short counts and EINTR retried until done);
 *    its ticket completes when all its chunks have; the first error (lowest
 *    failing offset) is kept and the chunks not yet started are skipped.
 *  - a request must not overlap the extent of an in-flight write, nor may a
 *    write overlap an in-flight read (mp_spill_submit refuses: wait first);
 *    a read must lie inside what was submitted for writing (offset + nbytes <=
 *    the largest end of a write so far).
 *  - every ticket is waited on once (mp_spill_wait releases it and reports its
 *    error); mp_spill_poll only says whether it is done. At most
 *    MP_SPILL_MAX_TICKETS tickets are held (in flight or done, not yet waited).
 * Why threads of its own and not the CPU pool (threadpool.c): mp_parallel_for
 * is a blocking fork-join over one job at a time (its caller waits for every
 * range), while a spill request must return at once and overlap compute, and
 * an I/O thread sleeping in a syscall must not hold a core-sized slot of the
 * pool the AdamW and cross-entropy kernels share. The I/O threads mostly sleep
 * in the kernel; a few give the device a queue depth of a few chunks.
 *
 * Thread safety: every function may be called from any thread; mp_spill_close
 * waits for the requests in flight and is idempotent; after it, submit fails
 * with MP_ERR_INVALID, while tickets still held may be polled (done) and
 * waited on (their results). */
#ifndef MP_SPILL_H
#define MP_SPILL_H

#include "moepeak.h"

#define MP_SPILL_ALIGN 4096                 /* O_DIRECT's buffer/offset/length unit on every common device */
#define MP_SPILL_CHUNK ((int64_t)8 << 20)   /* bytes per pread/pwrite: large enough to stream, small enough to
                                               spread one large request over the I/O threads */
#define MP_SPILL_MAX_TICKETS 1024           /* tickets held at once per file */
#define MP_SPILL_MAX_THREADS 64

enum { MP_SPILL_DIRECT_AUTO = -1, MP_SPILL_DIRECT_OFF = 0, MP_SPILL_DIRECT_ON = 1 };

typedef struct mp_spill mp_spill;

/* What an OS error was about: errno, the request's range, where it failed. */
typedef struct {
  int err;          /* errno; 0: none */
  int is_write;
  int64_t offset;   /* the request: [offset, offset + nbytes) */
  int64_t nbytes;
  int64_t at;       /* the file offset the failing call started at */
} mp_spill_error;

/* Create the spill file in `dir` with `threads` I/O threads (1..MP_SPILL_MAX_THREADS).
 * direct: MP_SPILL_DIRECT_* (ON: fail with EINVAL where refused). use_tmpfile 0:
 * skip O_TMPFILE (create + unlink). On MP_ERR_SYS, *err is the errno. */
mp_status mp_spill_open(const char *dir, int64_t capacity, int threads, int direct, int use_tmpfile, mp_spill **out,
                        int *err);
int mp_spill_direct(const mp_spill *f);        /* 1: O_DIRECT, 0: buffered */
const char *mp_spill_dir(const mp_spill *f);
int mp_spill_threads(const mp_spill *f);
int64_t mp_spill_written_end(mp_spill *f);     /* largest offset + nbytes of a write submitted */
int mp_spill_in_flight(mp_spill *f);           /* requests not yet complete */

/* Queue a request (is_write: buffer -> file); *ticket > 0 identifies it.
 * MP_ERR_INVALID: closed, hazard, read past the written end, or too many tickets. */
mp_status mp_spill_submit(mp_spill *f, int is_write, void *buf, int64_t nbytes, int64_t offset, int64_t *ticket);
/* *done = 1 when the request has completed (successfully or not). */
mp_status mp_spill_poll(mp_spill *f, int64_t ticket, int *done);
/* Block until the request completes, release its ticket; MP_ERR_SYS with *e filled on an I/O error. */
mp_status mp_spill_wait(mp_spill *f, int64_t ticket, mp_spill_error *e);
/* Wait for every request in flight, stop the threads, close the file (its space is freed). */
mp_status mp_spill_close(mp_spill *f);
/* mp_spill_close, then free f (NULL: nothing). */
void mp_spill_free(mp_spill *f);

#endif
