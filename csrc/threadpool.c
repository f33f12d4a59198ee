/* threadpool.c: a persistent pthread pool for the CPU kernels.
 *
 * Invariants:
 *  - One job at a time: run_lock serialises callers of mp_parallel_for.
 *  - A job is published under `mu` by bumping `generation`; worker w runs
 *    range w (w >= 1) of that job, the caller runs range 0, and the caller
 *    waits until `pending` drops to 0 before returning (so `ctx` may live on
 *    the caller's stack).
 *  - Workers are created lazily and never destroyed (they sleep on `cv`).
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
  uint64_t generation;
  int active;               /* ranges in the current job (including range 0) */
  int pending;              /* ranges not yet finished by workers */
  int64_t n, chunk;
  mp_range_fn fn;
  void *ctx;
} mp_pool;

static mp_pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                       PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, NULL, NULL};
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
    while (pool.generation == seen) pthread_cond_wait(&pool.cv, &pool.mu);
    seen = pool.generation;
    if (idx >= pool.active) continue;
    pthread_mutex_unlock(&pool.mu);
    run_range(idx);
    pthread_mutex_lock(&pool.mu);
    if (--pool.pending == 0) pthread_cond_signal(&pool.done_cv);
  }
  return NULL;
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
    pthread_t t;
    pthread_attr_t attr;
    start_generation[pool.nworkers + 1] = pool.generation;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.nworkers + 1));
    pthread_attr_destroy(&attr);
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
