/* moepeak.h: what every C and CUDA C file of moepeak shares.
 *
 * Conventions (docs/design.md section 4):
 *  - Library functions return an mp_status (MP_OK == 0). On failure they
 *    record "file:line: message" with mp_set_error() and jump to one `fail:`
 *    label that frees what they own. Nothing calls exit() or abort().
 *  - Only the binding layer (functions taking PyObject*) raises Python
 *    exceptions; it turns a status into an exception carrying mp_last_error().
 *  - CUDA launchers live in cuda/ (*.cu files), are extern "C", take a cudaStream_t
 *    passed as uintptr_t, and check cudaGetLastError() after each launch.
 *  - This header is included by C11 (csrc) and C++17 (nvcc) translation units,
 *    so it uses no Python or CUDA types.
 */
#ifndef MOEPEAK_H
#define MOEPEAK_H

#include <stddef.h>
#include <stdint.h>

#include "mp_abi.h" /* dtype codes and row layouts shared with Python */

#ifdef __cplusplus
extern "C" {
#endif

#ifndef MP_WITH_CUDA
#define MP_WITH_CUDA 0
#endif

typedef int mp_status;
enum {
  MP_OK = 0,
  MP_ERR_INVALID = 1, /* bad argument reaching C (the binding should have caught it) */
  MP_ERR_NOMEM = 2,   /* host allocation failed */
  MP_ERR_CUDA = 3,    /* a CUDA runtime call or kernel launch failed */
  MP_ERR_NCCL = 4,    /* an NCCL call failed */
  MP_ERR_NO_CUDA = 5, /* built without CUDA */
  MP_ERR_SYS = 6      /* an OS call failed (pthread, dlopen, ...) */
};

/* Thread-local last error message ("file:line: text"). */
void mp_set_error(const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
const char *mp_last_error(void);

#define MP_FAIL(status_var, code, ...)                  \
  do {                                                  \
    mp_set_error(__FILE__, __LINE__, __VA_ARGS__);      \
    (status_var) = (code);                              \
    goto fail;                                          \
  } while (0)

/* Run `expr` (an mp_status); on failure keep its message and goto fail. */
#define MP_TRY(status_var, expr)                        \
  do {                                                  \
    (status_var) = (expr);                              \
    if ((status_var) != MP_OK) goto fail;               \
  } while (0)

/* ---------------------------------------------------------------------------
 * CPU thread pool (csrc/threadpool.c). A persistent pthread pool; no OpenMP,
 * so it never fights torch's own OpenMP/TBB runtime for the cores.
 * mp_parallel_for splits [0, n) into at most `nthreads` contiguous ranges,
 * each a multiple of `grain` (except the last), and calls
 * fn(ctx, begin, end, worker_index) on each, the calling thread taking one.
 * Calls from several threads are serialised. nthreads <= 0 means the default
 * (the CPUs in this process's affinity mask, or mp_pool_set_default_threads).
 * -------------------------------------------------------------------------*/
typedef void (*mp_range_fn)(void *ctx, int64_t begin, int64_t end, int worker);
mp_status mp_parallel_for(int64_t n, int64_t grain, int nthreads, mp_range_fn fn, void *ctx);
int mp_pool_default_threads(void);
void mp_pool_set_default_threads(int n);
int mp_pool_workers(void);     /* worker threads alive now (excluding callers) */
void mp_pool_trim(int keep);   /* join workers beyond the first `keep` (waits for a running job) */

/* CPU features detected at run time (csrc/cpu_features.c). */
enum { MP_ISA_SCALAR = 0, MP_ISA_AVX2 = 1, MP_ISA_AVX512 = 2 };
int mp_cpu_best_isa(void); /* the best ISA this CPU supports */

/* ---------------------------------------------------------------------------
 * CUDA runtime wrappers (cuda/runtime.cu). Streams and events are passed as
 * uintptr_t so C code needs no CUDA headers. With MP_WITH_CUDA == 0 none of
 * these exist; callers guard with #if MP_WITH_CUDA.
 * -------------------------------------------------------------------------*/
#if MP_WITH_CUDA
mp_status mp_cu_set_device(int device);
mp_status mp_cu_device_count(int *count);
mp_status mp_cu_host_alloc(void **ptr, size_t nbytes);
mp_status mp_cu_host_free(void *ptr);
mp_status mp_cu_host_register(void *ptr, size_t nbytes);
mp_status mp_cu_host_unregister(void *ptr);
mp_status mp_cu_memcpy_async(void *dst, const void *src, size_t nbytes, uintptr_t stream);
mp_status mp_cu_stream_create(uintptr_t *stream, int priority);
mp_status mp_cu_stream_destroy(uintptr_t stream);
mp_status mp_cu_stream_synchronize(uintptr_t stream);
mp_status mp_cu_stream_wait_event(uintptr_t stream, uintptr_t event);
mp_status mp_cu_event_create(uintptr_t *event);
mp_status mp_cu_event_destroy(uintptr_t event);
mp_status mp_cu_event_record(uintptr_t event, uintptr_t stream);
mp_status mp_cu_event_synchronize(uintptr_t event);
mp_status mp_cu_event_query(uintptr_t event, int *done);
#endif

#ifdef __cplusplus
}
#endif
#endif /* MOEPEAK_H */
