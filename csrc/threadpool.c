/* threadpool.c: a persistent pthread pool for the CPU kernels.
 *
 * Invariants:
 *  - One job at a time: run_lock serialises callers of mp_parallel_for.
 *  - A job is published under `mu` by bumping `generation`; worker w runs
 *    range w (w >= 1) of that job, the caller runs range 0, and the caller
 *    waits until `pending` drops to 0 before returning (so `ctx` may live on
 *    the caller's stack).
 *  - Workers are created lazily (joinable, indices 1..nworkers) and sleep on
 *    `cv`; mp_pool_trim(k) retires workers k+1..nworkers (they see
 *    idx > keep, leave their loop, and are joined) so a request for more
 *    threads than the default does not hold them for the process's lifetime.
 *  - The pool is process-wide state on purpose: one set of worker threads
 *    shared by every component and every interpreter of the process.
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "moepeak.h"

#define MP_MAX_THREADS 256

typedef struct {
  pthread_mutex_t run_lock; /* serialises jobs */
  pthread_mutex_t mu;       /* guards every field below */
  pthread_cond_t cv;        /* workers wait for a new generation */
  pthread_cond_t done_cv;   /* caller waits for pending == 0 */
  int nworkers;             /* threads created so far (excluding callers) */
  int keep;                 /* workers with index > keep leave (MP_MAX_THREADS: none) */
  uint64_t generation;
  int active;               /* ranges in the current job (including range 0) */
  int pending;              /* ranges not yet finished by workers */
  int64_t n, chunk;
  mp_range_fn fn;
  void *ctx;
} mp_pool;

static mp_pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                       PTHREAD_COND_INITIALIZER, 0, MP_MAX_THREADS, 0, 0, 0, 0, 0, NULL, NULL};
static pthread_t worker_thread[MP_MAX_THREADS + 1]; /* [idx] for idx in 1..nworkers */
static int default_threads = 0;
/* Generation each worker was created at (set under `mu` by its creator), so a
 * worker created for the job being published cannot miss that job. */
static uint64_t start_generation[MP_MAX_THREADS + 1];

int mp_pool_default_threads(void) {
  if (default_threads > 0) return default_threads;
  int n = 0;
#ifdef CPU_COUNT
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
#endif
  if (n <= 0) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (n <= 0) n = 1;
  return n > MP_MAX_THREADS ? MP_MAX_THREADS : n;
}

void mp_pool_set_default_threads(int n) { default_threads = n > MP_MAX_THREADS ? MP_MAX_THREADS : n; }

static void run_range(int idx) {
  int64_t b = (int64_t)idx * pool.chunk;
  int64_t e = b + pool.chunk;
  if (e > pool.n) e = pool.n;
  if (b < e) pool.fn(pool.ctx, b, e, idx);
}

static void *worker_main(void *arg) {
  int idx = (int)(intptr_t)arg; /* 1-based: range 0 belongs to the caller */
  pthread_mutex_lock(&pool.mu);
  uint64_t seen = start_generation[idx];
  for (;;) {
    while (pool.generation == seen && idx <= pool.keep) pthread_cond_wait(&pool.cv, &pool.mu);
    if (idx > pool.keep) break; /* retired by mp_pool_trim (never during a job: it holds run_lock) */
    seen = pool.generation;
    if (idx >= pool.active) continue;
    pthread_mutex_unlock(&pool.mu);
    run_range(idx);
    pthread_mutex_lock(&pool.mu);
    if (--pool.pending == 0) pthread_cond_signal(&pool.done_cv);
  }
  pthread_mutex_unlock(&pool.mu);
  return NULL;
}

int mp_pool_workers(void) {
  pthread_mutex_lock(&pool.mu);
  int n = pool.nworkers;
  pthread_mutex_unlock(&pool.mu);
  return n;
}

void mp_pool_trim(int keep) {
  if (keep < 0) keep = 0;
  pthread_mutex_lock(&pool.run_lock); /* no job in flight while workers leave */
  pthread_mutex_lock(&pool.mu);
  int n = pool.nworkers;
  if (keep >= n) {
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.run_lock);
    return;
  }
  pool.keep = keep;
  pthread_cond_broadcast(&pool.cv);
  pthread_mutex_unlock(&pool.mu);
  for (int idx = keep + 1; idx <= n; idx++) pthread_join(worker_thread[idx], NULL);
  pthread_mutex_lock(&pool.mu);
  pool.nworkers = keep;
  pool.keep = MP_MAX_THREADS;
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&pool.run_lock);
}

mp_status mp_parallel_for(int64_t n, int64_t grain, int nthreads, mp_range_fn fn, void *ctx) {
  mp_status st = MP_OK;
  if (n <= 0) return MP_OK;
  if (grain < 1) grain = 1;
  if (nthreads <= 0) nthreads = mp_pool_default_threads();
  if (nthreads > MP_MAX_THREADS) nthreads = MP_MAX_THREADS;
  int64_t units = (n + grain - 1) / grain;
  if (units < nthreads) nthreads = (int)units;
  if (nthreads <= 1) {
    fn(ctx, 0, n, 0);
    return MP_OK;
  }
  pthread_mutex_lock(&pool.run_lock);
  pthread_mutex_lock(&pool.mu);
  while (pool.nworkers < nthreads - 1) {
    start_generation[pool.nworkers + 1] = pool.generation;
    int rc = pthread_create(&worker_thread[pool.nworkers + 1], NULL, worker_main, (void *)(intptr_t)(pool.nworkers + 1));
    if (rc != 0) {
      if (pool.nworkers == 0) { /* no helpers at all: run serially */
        pthread_mutex_unlock(&pool.mu);
        pthread_mutex_unlock(&pool.run_lock);
        fn(ctx, 0, n, 0);
        return MP_OK;
      }
      nthreads = pool.nworkers + 1;
      break;
    }
    pool.nworkers++;
  }
  int64_t chunk_units = (units + nthreads - 1) / nthreads;
  pool.chunk = chunk_units * grain;
  pool.active = (int)((n + pool.chunk - 1) / pool.chunk);
  pool.n = n;
  pool.fn = fn;
  pool.ctx = ctx;
  pool.pending = pool.active - 1;
  pool.generation++;
  pthread_cond_broadcast(&pool.cv);
  pthread_mutex_unlock(&pool.mu);

  run_range(0);

  pthread_mutex_lock(&pool.mu);
  while (pool.pending > 0) pthread_cond_wait(&pool.done_cv, &pool.mu);
  pool.fn = NULL;
  pool.ctx = NULL;
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&pool.run_lock);
  return st;
}
