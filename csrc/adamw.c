/* adamw.c: StreamAdamW's C side: the bindings of the CPU AdamW kernel
 * and the per-step bucket pipeline, driven from C with the GIL released.
 *
 * The pipeline (one step, nb buckets, G grad slots, P param slots):
 *
 *   current stream --ev_start--> d2h stream, h2d stream        (grads final, params free)
 *   d2h:  grads of bucket i   -> pinned gslot[i % G], event gev[i % G]
 *   CPU:  wait gev[i % G]; wait pev[i % P] (slot's previous H2D done);
 *         AdamW on bucket i (fp32 master/m/v in host RAM), writing the new
 *         params (param dtype) into pinned pslot[i % P]; then gslot[i % G] is
 *         free, so the D2H of bucket i + G is issued into it
 *   h2d:  pslot[i % P] -> params of bucket i, event pev[i % P]
 *   current stream waits on the last pev (the h2d stream is in order, so it
 *   covers every bucket): the next forward sees the new params.
 *
 * So the D2H of buckets i+1..i+G-1, the CPU work of bucket i and the H2D of
 * bucket i-1 run at once. Every D2H has completed (the CPU waited on it)
 * before step returns, so the caller may free the grads right away; the
 * pinned slots are allocated once per plan and never grow. No GPU memory is
 * allocated: copies go straight between the torch tensors and pinned slots.
 *
 * Plan buffers (built once in Python, moepeak/stream_adamw/op.py):
 *   segs:  [nseg, 5] int64 (param index, first element, n, gslot byte offset,
 *          pslot byte offset); a segment is a piece of one parameter.
 *   bucket_seg: [nb + 1] int64, bucket b holds segments bucket_seg[b] ..
 *          bucket_seg[b+1]-1.
 * Per-step buffers:
 *   ptrs:  [nparam, 9] int64 (master, exp_avg, exp_avg_sq, grad, param or
 *          low-precision copy, numel, grad dtype, param dtype, max_exp_avg_sq
 *          or 0 = no amsgrad); grad 0 = skip
 *          (the plan covers every CUDA param of the optimizer, so a param
 *          without a grad this step keeps its bucket slot but moves nothing).
 *   hyper: [nparam, 7] double (lr, beta1, beta2, eps, weight_decay, step,
 *          maximize 0/1).
 *   torch_threads, torch_vlen: emulate torch's chunking (adamw_kernels.c) so
 *          the fp32 results are bitwise those of torch's fused CPU AdamW run
 *          with that many threads; torch_vlen 0 = plain vector formula.
 *   state_dtype (keyword, default 0): the dtype code of every row's exp_avg,
 *          exp_avg_sq and max_exp_avg_sq: 0 fp32, 1 bf16 (stochastic rounding,
 *          adamw_kernels.h); the master is fp32 either way.
 *   seed (keyword, default 0): the rounding seed of bf16 state: an int in
 *          [0, 2^64) for every row, or a buffer of [nparam] int64 (one seed per
 *          row, read as uint64 bit patterns); ignored for fp32 state.
 */
#include <stdlib.h>
#include <string.h>

#include "adamw_kernels.h"
#include "mp_python.h"

#define PTR_COLS 9
#define HYP_COLS 7
/* Bounds every binding checks before touching memory, chosen so that no
 * product or sum of checked values below can overflow int64:
 * numel and offsets < 2^48 elements (1 PiB of fp32), bytes < 2^52. */
#define MAX_NUMEL ((int64_t)1 << 48)
#define MAX_BYTES ((int64_t)1 << 52)
#define MAX_TORCH_THREADS 4096
#define MAX_TORCH_VLEN 64

static int dt_size(int dt) { return dt == MP_DT_F32 ? 4 : 2; }

/* The optional state arguments of adamw_cpu / adamw_plan_step. */
typedef struct {
  int sdt;            /* state dtype code */
  PyObject *seed;     /* borrowed: int or buffer; NULL = 0 */
  Py_buffer seeds;    /* the per-row seeds when `seed` is a buffer (buf NULL otherwise) */
  uint64_t seed_all;  /* the seed of every row when `seed` is an int */
} state_args;

/* Check the state arguments for n rows (fn: the binding's name for messages).
 * Returns 0 and sets ValueError/TypeError naming the argument on bad input. */
static int parse_state_args(const char *fn, state_args *a, Py_ssize_t n) {
  if (a->sdt != MP_DT_F32 && a->sdt != MP_DT_BF16) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: state_dtype must be 0 (fp32) or 1 (bf16), got %d", fn, a->sdt);
    return 0;
  }
  if (a->seed == NULL || a->seed == Py_None) return 1;
  if (PyLong_Check(a->seed)) {
    a->seed_all = PyLong_AsUnsignedLongLong(a->seed);
    if (a->seed_all == (uint64_t)-1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: seed must be an int in [0, 2^64) or a buffer of %zd int64, "
                   "got %R", fn, n, a->seed);
      return 0;
    }
    return 1;
  }
  if (PyObject_GetBuffer(a->seed, &a->seeds, PyBUF_SIMPLE) < 0) {
    a->seeds.buf = NULL; /* not held: the caller's cleanup must not release it */
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "moepeak._C.%s: seed must be an int or a buffer of %zd int64 (one per row), "
                 "got %s", fn, n, Py_TYPE(a->seed)->tp_name);
    return 0;
  }
  if (a->seeds.len != n * (Py_ssize_t)sizeof(int64_t)) {
    PyErr_Format(PyExc_ValueError, "moepeak._C.%s: seed buffer must hold %zd int64 (one per row), got %zd bytes",
                 fn, n, a->seeds.len);
    return 0;
  }
  return 1;
}

static uint64_t row_seed(const state_args *a, Py_ssize_t i) {
  if (!a->seeds.buf) return a->seed_all;
  uint64_t s;
  memcpy(&s, (const char *)a->seeds.buf + (size_t)i * sizeof s, sizeof s);
  return s;
}

/* Parse the per-step buffers into coefficient records. Returns 0 and sets a
 * Python error on a malformed buffer. */
static int parse_step(const char *fn, Py_buffer *ptrs, Py_buffer *hyper, int tthreads, int tvlen, state_args *sa,
                      Py_ssize_t *nparam, mp_adamw_coef **coef) {
  Py_ssize_t n = ptrs->len / (Py_ssize_t)(PTR_COLS * sizeof(int64_t));
  if (ptrs->len != n * (Py_ssize_t)(PTR_COLS * sizeof(int64_t)) ||
      hyper->len != n * (Py_ssize_t)(HYP_COLS * sizeof(double))) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw ptrs must be [n, %d] int64 and hyper [n, %d] float64 "
                 "(got %zd and %zd bytes)", PTR_COLS, HYP_COLS, ptrs->len, hyper->len);
    return 0;
  }
  if (tthreads < 1 || tthreads > MAX_TORCH_THREADS || tvlen < 0 || tvlen > MAX_TORCH_VLEN) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw torch_threads must be in [1, %d] and torch_vlen in [0, %d], "
                 "got %d and %d", MAX_TORCH_THREADS, MAX_TORCH_VLEN, tthreads, tvlen);
    return 0;
  }
  if (!parse_state_args(fn, sa, n)) return 0;
  const int64_t *P = (const int64_t *)ptrs->buf;
  const double *H = (const double *)hyper->buf;
  *coef = (mp_adamw_coef *)malloc(sizeof(mp_adamw_coef) * (size_t)(n > 0 ? n : 1));
  if (!*coef) {
    PyErr_NoMemory();
    return 0;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    const int64_t *r = P + i * PTR_COLS;
    /* numel in [0, MAX_NUMEL), dtype codes in range, and a row with a grad
     * and elements names its master, exp_avg and exp_avg_sq */
    if (r[5] < 0 || r[5] >= MAX_NUMEL || r[6] < 0 || r[6] > 2 || r[7] < 0 || r[7] > 2 ||
        (r[3] != 0 && r[5] > 0 && (r[0] == 0 || r[1] == 0 || r[2] == 0))) {
      free(*coef);
      *coef = NULL;
      PyErr_Format(PyExc_ValueError, "moepeak: adamw ptrs row %zd is malformed (numel %lld must be in [0, 2^48), "
                   "dtype codes %lld, %lld in [0, 2], master/exp_avg/exp_avg_sq non-null)", i, (long long)r[5],
                   (long long)r[6], (long long)r[7]);
      return 0;
    }
    /* the state tensors a row with a grad reads are aligned to their dtype (ASan/UBSan-clean loads) */
    const int ss = dt_size(sa->sdt);
    if (r[3] != 0 && r[5] > 0 && (r[1] % ss != 0 || r[2] % ss != 0 || r[8] % ss != 0)) {
      free(*coef);
      *coef = NULL;
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: ptrs row %zd: exp_avg, exp_avg_sq and max_exp_avg_sq must be "
                   "aligned to their dtype's %d bytes (state_dtype %d)", fn, i, ss, sa->sdt);
      return 0;
    }
    const double *h = H + i * HYP_COLS;
    mp_adamw_coef_init(&(*coef)[i], h[0], h[1], h[2], h[3], h[4], h[5], h[6] != 0.0);
    mp_adamw_coef_set_tails(&(*coef)[i], r[5], tthreads, tvlen);
    mp_adamw_coef_set_rounding(&(*coef)[i], row_seed(sa, i), h[5]);
  }
  *nparam = n;
  return 1;
}

static int check_isa_threads(int isa, int threads) {
  if (isa < 0 || isa > mp_cpu_best_isa()) {
    PyErr_Format(PyExc_ValueError, "moepeak: isa must be in [0, %d] on this CPU (0 scalar, 1 avx2, 2 avx512), got %d",
                 mp_cpu_best_isa(), isa);
    return 0;
  }
  if (threads < 0 || threads > 256) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw threads must be in [0, 256] (0: the pool's default), got %d",
                 threads);
    return 0;
  }
  return 1;
}

/* adamw_cpu(ptrs, hyper, isa, threads, torch_threads, torch_vlen, state_dtype=0, seed=0): every tensor on
 * the CPU, updated in place (the "param" column is the low-precision copy to write, or 0). */
static PyObject *py_adamw_cpu(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"ptrs", "hyper", "isa", "threads", "torch_threads", "torch_vlen", "state_dtype", "seed",
                           NULL};
  Py_buffer ptrs = {0}, hyper = {0};
  int isa = 0, threads = 0, tthreads = 1, tvlen = 0;
  state_args sa = {MP_DT_F32, NULL, {0}, 0};
  mp_adamw_coef *coef = NULL;
  mp_adamw_seg *segs = NULL;
  PyObject *ret = NULL;
  Py_ssize_t n = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*iiii|iO:adamw_cpu", kwlist, &ptrs, &hyper, &isa, &threads,
                                   &tthreads, &tvlen, &sa.sdt, &sa.seed))
    return NULL;
  if (!check_isa_threads(isa, threads) || !parse_step("adamw_cpu", &ptrs, &hyper, tthreads, tvlen, &sa, &n, &coef))
    goto fail;
  segs = (mp_adamw_seg *)calloc((size_t)(n > 0 ? n : 1), sizeof(mp_adamw_seg));
  if (!segs) {
    PyErr_NoMemory();
    goto fail;
  }
  int ns = 0;
  const int64_t *P = (const int64_t *)ptrs.buf;
  for (Py_ssize_t i = 0; i < n; i++) {
    const int64_t *r = P + i * PTR_COLS;
    if (r[3] == 0 || r[5] == 0) continue; /* no grad / empty */
    mp_adamw_seg s = {.p = (float *)(intptr_t)r[0],
                      .m = (void *)(intptr_t)r[1],
                      .v = (void *)(intptr_t)r[2],
                      .vmax = (void *)(intptr_t)r[8],
                      .g = (const void *)(intptr_t)r[3],
                      .lp = (void *)(intptr_t)r[4],
                      .n = r[5],
                      .base = 0,
                      .gdt = (int)r[6],
                      .ldt = (int)r[7],
                      .coef = &coef[i],
                      .lp_stream = 0,
                      .sdt = sa.sdt};
    segs[ns++] = s;
  }
  mp_status st;
  MP_CALL_NOGIL(st, mp_adamw_run(segs, ns, isa, threads));
  ret = Py_None;
  Py_INCREF(ret);
fail:
  free(segs);
  free(coef);
  if (sa.seeds.buf) PyBuffer_Release(&sa.seeds);
  PyBuffer_Release(&ptrs);
  PyBuffer_Release(&hyper);
  return ret;
}

/* ---------------------------------------------------------------- pipeline
 * `host` plans (tests, any build) run the same schedule on CPU tensors with
 * memcpy in place of the copy engines and no events; CUDA plans need a CUDA
 * build. The wrappers below are the only place that differs. */

typedef struct {
  int64_t nseg, nb, nparam, gslots, pslots;
  int host;            /* 1: memcpy + no events (CPU tensors); 0: CUDA */
  int64_t *segs;       /* [nseg, 5] */
  int64_t *bucket_seg; /* [nb + 1] */
  int64_t max_bucket_segs;
  size_t gslot_bytes, pslot_bytes;
  char **gslot, **pslot;     /* pinned [gslots][gslot_bytes], [pslots][pslot_bytes] */
  uintptr_t *gev, *pev;      /* one event per slot */
  uintptr_t ev_start, d2h, h2d;
  mp_adamw_seg *work;        /* [max_bucket_segs] scratch for one bucket */
} adamw_plan;

#if MP_WITH_CUDA
#define PL_CUDA(expr) (expr)
#else
#define PL_CUDA(expr) (mp_set_error(__FILE__, __LINE__, "moepeak was built without CUDA"), MP_ERR_NO_CUDA)
#endif

static mp_status pl_copy(const adamw_plan *p, void *dst, const void *src, size_t n, uintptr_t stream) {
  (void)stream;
  if (p->host) {
    memcpy(dst, src, n);
    return MP_OK;
  }
  return PL_CUDA(mp_cu_memcpy_async(dst, src, n, stream));
}
static mp_status pl_record(const adamw_plan *p, uintptr_t ev, uintptr_t stream) {
  (void)ev;
  (void)stream;
  return p->host ? MP_OK : PL_CUDA(mp_cu_event_record(ev, stream));
}
static mp_status pl_sync(const adamw_plan *p, uintptr_t ev) {
  (void)ev;
  return p->host ? MP_OK : PL_CUDA(mp_cu_event_synchronize(ev));
}
static mp_status pl_wait(const adamw_plan *p, uintptr_t stream, uintptr_t ev) {
  (void)ev;
  (void)stream;
  return p->host ? MP_OK : PL_CUDA(mp_cu_stream_wait_event(stream, ev));
}

#if MP_WITH_CUDA
/* fn(ev[s]) for each non-null event of ev [n] (ev may be NULL); statuses ignored (teardown). */
static void each_event(const uintptr_t *ev, int64_t n, mp_status (*fn)(uintptr_t)) {
  for (int64_t s = 0; ev && s < n; s++)
    if (ev[s]) fn(ev[s]);
}

/* fn(slot[s]) for each non-null slot of slot [n] (slot may be NULL). */
static void each_slot(char **slot, int64_t n, mp_status (*fn)(void *)) {
  for (int64_t s = 0; slot && s < n; s++)
    if (slot[s]) fn(slot[s]);
}
#endif

static void plan_free(adamw_plan *p) {
  if (!p) return;
  if (p->host) {
    for (int64_t s = 0; p->gslot && s < p->gslots; s++) free(p->gslot[s]);
    for (int64_t s = 0; p->pslot && s < p->pslots; s++) free(p->pslot[s]);
  } else {
#if MP_WITH_CUDA
    /* Slots may still be read by an H2D in flight: wait before freeing. */
    each_event(p->pev, p->pslots, mp_cu_event_synchronize);
    each_event(p->gev, p->gslots, mp_cu_event_synchronize);
    each_slot(p->gslot, p->gslots, mp_cu_host_free);
    each_slot(p->pslot, p->pslots, mp_cu_host_free);
    each_event(p->gev, p->gslots, mp_cu_event_destroy);
    each_event(p->pev, p->pslots, mp_cu_event_destroy);
    if (p->ev_start) mp_cu_event_destroy(p->ev_start);
    if (p->d2h) mp_cu_stream_destroy(p->d2h);
    if (p->h2d) mp_cu_stream_destroy(p->h2d);
#endif
  }
  free(p->gslot);
  free(p->pslot);
  free(p->gev);
  free(p->pev);
  free(p->segs);
  free(p->bucket_seg);
  free(p->work);
  free(p);
}

static void plan_capsule_free(PyObject *cap) {
  adamw_plan *p = (adamw_plan *)PyCapsule_GetPointer(cap, "moepeak.adamw_plan");
  if (p) plan_free(p);
}

static mp_status plan_alloc(adamw_plan *p) {
  mp_status st = MP_OK;
  if (p->host) {
    for (int64_t s = 0; s < p->gslots; s++)
      if (!(p->gslot[s] = (char *)malloc(p->gslot_bytes))) MP_FAIL(st, MP_ERR_NOMEM, "adamw: no host memory for a slot");
    for (int64_t s = 0; s < p->pslots; s++)
      if (!(p->pslot[s] = (char *)malloc(p->pslot_bytes))) MP_FAIL(st, MP_ERR_NOMEM, "adamw: no host memory for a slot");
    return MP_OK;
  }
#if MP_WITH_CUDA
  for (int64_t s = 0; s < p->gslots; s++) {
    MP_TRY(st, mp_cu_host_alloc((void **)&p->gslot[s], p->gslot_bytes));
    MP_TRY(st, mp_cu_event_create(&p->gev[s]));
  }
  for (int64_t s = 0; s < p->pslots; s++) {
    MP_TRY(st, mp_cu_host_alloc((void **)&p->pslot[s], p->pslot_bytes));
    MP_TRY(st, mp_cu_event_create(&p->pev[s]));
  }
  MP_TRY(st, mp_cu_event_create(&p->ev_start));
  MP_TRY(st, mp_cu_stream_create(&p->d2h, 0));
  MP_TRY(st, mp_cu_stream_create(&p->h2d, 0));
#else
  MP_FAIL(st, MP_ERR_NO_CUDA, "moepeak was built without CUDA");
#endif
fail:
  return st;
}

/* adamw_plan_create(segs, bucket_seg, nparam, gslot_bytes, pslot_bytes,
 * gslots, pslots, host) -> capsule. Call with the parameters' device current. */
static PyObject *py_adamw_plan_create(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer segs = {0}, bseg = {0};
  long long nparam, gbytes, pbytes, gslots, pslots;
  int host = 0;
  adamw_plan *p = NULL;
  PyObject *cap = NULL;
  if (!PyArg_ParseTuple(args, "y*y*LLLLLp", &segs, &bseg, &nparam, &gbytes, &pbytes, &gslots, &pslots, &host))
    return NULL;
#if !MP_WITH_CUDA
  if (!host) {
    PyBuffer_Release(&segs);
    PyBuffer_Release(&bseg);
    return mp_raise_no_cuda("StreamAdamW on CUDA parameters");
  }
#endif
  int64_t nseg = segs.len / (Py_ssize_t)(5 * sizeof(int64_t));
  int64_t nb = bseg.len / (Py_ssize_t)sizeof(int64_t) - 1;
  if (segs.len != nseg * 5 * (Py_ssize_t)sizeof(int64_t) || nb < 1 || gslots < 2 || gslots > 64 || pslots < 1 ||
      pslots > 64 || gbytes <= 0 || gbytes >= MAX_BYTES || pbytes <= 0 || pbytes >= MAX_BYTES || nparam < 1 ||
      nparam >= MAX_NUMEL) {
    PyErr_SetString(PyExc_ValueError, "moepeak: adamw_plan_create: malformed plan");
    goto fail;
  }
  p = (adamw_plan *)calloc(1, sizeof(adamw_plan));
  if (!p) goto nomem;
  p->nseg = nseg;
  p->nb = nb;
  p->nparam = nparam;
  p->host = host;
  p->gslots = gslots;
  p->pslots = pslots;
  p->gslot_bytes = (size_t)gbytes;
  p->pslot_bytes = (size_t)pbytes;
  p->segs = (int64_t *)malloc((size_t)segs.len);
  p->bucket_seg = (int64_t *)malloc((size_t)bseg.len);
  p->gslot = (char **)calloc((size_t)gslots, sizeof(char *));
  p->pslot = (char **)calloc((size_t)pslots, sizeof(char *));
  p->gev = (uintptr_t *)calloc((size_t)gslots, sizeof(uintptr_t));
  p->pev = (uintptr_t *)calloc((size_t)pslots, sizeof(uintptr_t));
  if (!p->segs || !p->bucket_seg || !p->gslot || !p->pslot || !p->gev || !p->pev) goto nomem;
  memcpy(p->segs, segs.buf, (size_t)segs.len);
  memcpy(p->bucket_seg, bseg.buf, (size_t)bseg.len);
  p->max_bucket_segs = 1;
  for (int64_t b = 0; b < nb; b++) {
    int64_t k0 = p->bucket_seg[b], k1 = p->bucket_seg[b + 1];
    if (k0 < 0 || k1 < k0 || k1 > nseg) {
      PyErr_SetString(PyExc_ValueError, "moepeak: adamw_plan_create: bucket_seg out of range");
      goto fail;
    }
    if (k1 - k0 > p->max_bucket_segs) p->max_bucket_segs = k1 - k0;
  }
  for (int64_t k = 0; k < nseg; k++) {
    const int64_t *r = p->segs + 5 * k;
    /* every field bounded: r[1] + r[2] and r[3] + 4 * r[2] cannot overflow */
    if (r[0] < 0 || r[0] >= nparam || r[1] < 0 || r[1] >= MAX_NUMEL || r[2] <= 0 || r[2] >= MAX_NUMEL ||
        r[3] < 0 || r[3] >= gbytes || r[4] < 0 || r[4] >= pbytes) {
      PyErr_Format(PyExc_ValueError, "moepeak: adamw_plan_create: segment %lld malformed", (long long)k);
      goto fail;
    }
  }
  p->work = (mp_adamw_seg *)calloc((size_t)p->max_bucket_segs, sizeof(mp_adamw_seg));
  if (!p->work) goto nomem;
  mp_status st;
  MP_CALL_NOGIL(st, plan_alloc(p));
  cap = PyCapsule_New(p, "moepeak.adamw_plan", plan_capsule_free);
  if (!cap) goto fail;
  p = NULL;
  goto done;
nomem:
  PyErr_NoMemory();
fail:
  plan_free(p);
done:
  PyBuffer_Release(&segs);
  PyBuffer_Release(&bseg);
  return cap;
}

/* D2H of bucket b's grads into gslot[slot], then gev[slot] recorded. */
static mp_status issue_d2h(adamw_plan *p, const int64_t *P, int64_t b, int64_t slot) {
  mp_status st = MP_OK;
  for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1]; k++) {
    const int64_t *s = p->segs + 5 * k, *r = P + s[0] * PTR_COLS;
    if (r[3] == 0) continue;
    size_t es = (size_t)dt_size((int)r[6]);
    MP_TRY(st, pl_copy(p, p->gslot[slot] + s[3], (const char *)(intptr_t)r[3] + (size_t)s[1] * es,
                                  (size_t)s[2] * es, p->d2h));
  }
  MP_TRY(st, pl_record(p, p->gev[slot], p->d2h));
fail:
  return st;
}

/* One step through the pipeline (see the header comment), over the buckets
 * holding at least one segment with a grad: `active` [nb] scratch receives
 * their indices, and the slot ring turns over active buckets only (a step
 * that updates a few params, e.g. one bucket of StreamAdamW's overlap with
 * backward, costs no event round trips for the others). Slot events keep
 * their meaning across calls: pev[s] is the last H2D that read pslot[s]. */
/* Element `first` of a state tensor of dtype sdt at address `ptr` (0: NULL). */
static void *state_at(int64_t ptr, int64_t first, int sdt) {
  return ptr ? (char *)(intptr_t)ptr + (size_t)first * (size_t)dt_size(sdt) : NULL;
}

static mp_status run_pipeline(adamw_plan *p, const int64_t *P, const mp_adamw_coef *coef, uintptr_t cur, int isa,
                              int threads, int sdt, int64_t *active) {
  mp_status st = MP_OK;
  int64_t nb = 0;
  for (int64_t b = 0; b < p->nb; b++) {
    int any = 0;
    for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1] && !any; k++) any = P[p->segs[5 * k] * PTR_COLS + 3] != 0;
    if (any) active[nb++] = b;
  }
  if (nb == 0) return MP_OK;
  MP_TRY(st, pl_record(p, p->ev_start, cur));
  MP_TRY(st, pl_wait(p, p->d2h, p->ev_start));
  MP_TRY(st, pl_wait(p, p->h2d, p->ev_start));
  for (int64_t j = 0; j < nb && j < p->gslots; j++) MP_TRY(st, issue_d2h(p, P, active[j], j % p->gslots));
  for (int64_t j = 0; j < nb; j++) {
    int64_t b = active[j], gs = j % p->gslots, ps = j % p->pslots;
    MP_TRY(st, pl_sync(p, p->gev[gs])); /* grads of bucket b are in gslot[gs] */
    MP_TRY(st, pl_sync(p, p->pev[ps])); /* pslot[ps] no longer read by an H2D */
    int ns = 0;
    for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1]; k++) {
      const int64_t *s = p->segs + 5 * k, *r = P + s[0] * PTR_COLS;
      if (r[3] == 0) continue;
      mp_adamw_seg w = {.p = (float *)(intptr_t)r[0] + s[1],
                        .m = state_at(r[1], s[1], sdt),
                        .v = state_at(r[2], s[1], sdt),
                        .vmax = state_at(r[8], s[1], sdt),
                        .g = p->gslot[gs] + s[3],
                        .lp = p->pslot[ps] + s[4],
                        .n = s[2],
                        .base = s[1],
                        .gdt = (int)r[6],
                        .ldt = (int)r[7],
                        .coef = &coef[s[0]],
                        .lp_stream = 1 /* lp: a pinned slot */,
                        .sdt = sdt};
      p->work[ns++] = w;
    }
    MP_TRY(st, mp_adamw_run(p->work, ns, isa, threads));
    for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1]; k++) {
      const int64_t *s = p->segs + 5 * k, *r = P + s[0] * PTR_COLS;
      if (r[3] == 0) continue;
      size_t es = (size_t)dt_size((int)r[7]);
      MP_TRY(st, pl_copy(p, (char *)(intptr_t)r[4] + (size_t)s[1] * es, p->pslot[ps] + s[4],
                                    (size_t)s[2] * es, p->h2d));
    }
    MP_TRY(st, pl_record(p, p->pev[ps], p->h2d));
    if (j + p->gslots < nb) MP_TRY(st, issue_d2h(p, P, active[j + p->gslots], gs)); /* gslot[gs] is free again */
  }
  MP_TRY(st, pl_wait(p, cur, p->pev[(nb - 1) % p->pslots]));
fail:
  return st;
}

/* adamw_plan_step(plan, ptrs, hyper, current_stream, isa, threads, torch_threads, torch_vlen, state_dtype=0,
 * seed=0) */
static PyObject *py_adamw_plan_step(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"plan", "ptrs", "hyper", "stream", "isa", "threads", "torch_threads", "torch_vlen",
                           "state_dtype", "seed", NULL};
  PyObject *cap;
  Py_buffer ptrs = {0}, hyper = {0};
  unsigned long long cur;
  int isa, threads, tthreads, tvlen;
  state_args sa = {MP_DT_F32, NULL, {0}, 0};
  mp_adamw_coef *coef = NULL;
  int64_t *active = NULL;
  PyObject *ret = NULL;
  Py_ssize_t n = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oy*y*Kiiii|iO:adamw_plan_step", kwlist, &cap, &ptrs, &hyper, &cur,
                                   &isa, &threads, &tthreads, &tvlen, &sa.sdt, &sa.seed))
    return NULL;
  adamw_plan *p = (adamw_plan *)PyCapsule_GetPointer(cap, "moepeak.adamw_plan");
  if (!p) goto fail;
  if (!check_isa_threads(isa, threads) ||
      !parse_step("adamw_plan_step", &ptrs, &hyper, tthreads, tvlen, &sa, &n, &coef))
    goto fail;
  if (n != p->nparam) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw_plan_step: plan has %lld params, got %zd", (long long)p->nparam, n);
    goto fail;
  }
  /* Every segment must lie inside its parameter and its slots. */
  const int64_t *P = (const int64_t *)ptrs.buf;
  for (int64_t k = 0; k < p->nseg; k++) {
    const int64_t *s = p->segs + 5 * k, *r = P + s[0] * PTR_COLS;
    if (r[3] == 0) continue; /* no grad this step: skipped, never touched */
    /* overflow-safe: s[1], s[2], r[5] < 2^48 and s[3], s[4] < 2^52 (checked at creation / in parse_step) */
    if (s[2] > r[5] || s[1] > r[5] - s[2] || r[4] == 0 ||
        s[2] * dt_size((int)r[6]) > (int64_t)p->gslot_bytes - s[3] ||
        s[2] * dt_size((int)r[7]) > (int64_t)p->pslot_bytes - s[4]) {
      PyErr_Format(PyExc_ValueError, "moepeak: adamw_plan_step: segment %lld does not fit its param or slot "
                   "(the plan was built for other shapes or dtypes, or the param pointer is null)", (long long)k);
      goto fail;
    }
  }
  active = (int64_t *)malloc(sizeof(int64_t) * (size_t)p->nb);
  if (!active) {
    PyErr_NoMemory();
    goto fail;
  }
  mp_status st;
  MP_CALL_NOGIL(st, run_pipeline(p, (const int64_t *)ptrs.buf, coef, (uintptr_t)cur, isa, threads, sa.sdt, active));
  ret = Py_None;
  Py_INCREF(ret);
fail:
  free(coef);
  free(active);
  if (sa.seeds.buf) PyBuffer_Release(&sa.seeds);
  PyBuffer_Release(&ptrs);
  PyBuffer_Release(&hyper);
  return ret;
}

static PyObject *py_best_isa(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  return PyLong_FromLong(mp_cpu_best_isa());
}

PyMethodDef mp_adamw_methods[] = {
    {"adamw_cpu", (PyCFunction)(void (*)(void))py_adamw_cpu, METH_VARARGS | METH_KEYWORDS,
     "adamw_cpu(ptrs, hyper, isa, threads, torch_threads, torch_vlen, state_dtype=0, seed=0): AdamW on CPU "
     "tensors in place (GIL released); state_dtype 1: bf16 exp_avg/exp_avg_sq/max_exp_avg_sq with stochastic "
     "rounding keyed by seed (an int, or one int64 per row)."},
    {"adamw_plan_create", py_adamw_plan_create, METH_VARARGS,
     "adamw_plan_create(segs, bucket_seg, nparam, gslot_bytes, pslot_bytes, gslots, pslots, host) -> plan"},
    {"adamw_plan_step", (PyCFunction)(void (*)(void))py_adamw_plan_step, METH_VARARGS | METH_KEYWORDS,
     "adamw_plan_step(plan, ptrs, hyper, stream, isa, threads, torch_threads, torch_vlen, state_dtype=0, seed=0): "
     "one pipelined step (GIL released)."},
    {"cpu_best_isa", py_best_isa, METH_NOARGS, "cpu_best_isa() -> 0 scalar, 1 avx2, 2 avx512"},
    {NULL, NULL, 0, NULL},
};
