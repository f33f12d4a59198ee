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
 * The row buffers are the structs of mp_abi.h (Python: moepeak/core/abi.py).
 * Plan buffers (built once in Python, moepeak/stream_adamw/buckets.py):
 *   segs:  [nseg, 5] int64, mp_adamw_segment_row: a piece of one parameter.
 *   bucket_seg: [nb + 1] int64, bucket b holds segments bucket_seg[b] ..
 *          bucket_seg[b+1]-1.
 * Per-step buffers:
 *   ptrs:  [nparam, 9] int64, mp_adamw_param_row; grad 0 = skip (the plan
 *          covers every CUDA param of the optimizer, so a param without a grad
 *          this step keeps its bucket slot but moves nothing).
 *   hyper: [nparam, 7] double, mp_adamw_hyper_row.
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

/* Bounds every binding checks before touching memory, chosen so that no
 * product or sum of checked values below can overflow int64:
 * numel and offsets < 2^48 elements (1 PiB of fp32), bytes < 2^52. */
#define MAX_NUMEL ((int64_t)1 << 48)
#define MAX_BYTES ((int64_t)1 << 52)
#define MAX_TORCH_THREADS 4096
#define MAX_TORCH_VLEN 64

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
  if (a->sdt != MP_DTYPE_F32 && a->sdt != MP_DTYPE_BF16) {
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

/* The arguments adamw_cpu and adamw_plan_step share: the buffers are held
 * from argument parsing to step_call_release; parse_step fills coef and n. */
typedef struct {
  Py_buffer ptrs, hyper;
  int isa, threads, tthreads, tvlen;
  state_args sa;
  mp_adamw_coef *coef; /* one per row */
  Py_ssize_t n;        /* rows (parameters) */
} step_call;

#define STEP_CALL_INIT {.ptrs = {0}, .hyper = {0}, .tthreads = 1, .sa = {MP_DTYPE_F32, NULL, {0}, 0}}

static void step_call_release(step_call *c) {
  free(c->coef);
  c->coef = NULL;
  if (c->sa.seeds.buf) PyBuffer_Release(&c->sa.seeds);
  PyBuffer_Release(&c->ptrs);
  PyBuffer_Release(&c->hyper);
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

/* Check isa / threads and parse the per-step buffers into coefficient
 * records (c->coef, freed by step_call_release, also after an error).
 * Returns 0 and sets a Python error on bad input. */
static int parse_step(const char *fn, step_call *c) {
  if (!check_isa_threads(c->isa, c->threads)) return 0;
  const Py_buffer *ptrs = &c->ptrs, *hyper = &c->hyper;
  const int tthreads = c->tthreads, tvlen = c->tvlen;
  state_args *sa = &c->sa;
  Py_ssize_t n = ptrs->len / (Py_ssize_t)sizeof(mp_adamw_param_row);
  if (ptrs->len != n * (Py_ssize_t)sizeof(mp_adamw_param_row) ||
      hyper->len != n * (Py_ssize_t)sizeof(mp_adamw_hyper_row)) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw ptrs must be [n, %d] int64 and hyper [n, %d] float64 "
                 "(got %zd and %zd bytes)", (int)(sizeof(mp_adamw_param_row) / 8),
                 (int)(sizeof(mp_adamw_hyper_row) / 8), ptrs->len, hyper->len);
    return 0;
  }
  if (tthreads < 1 || tthreads > MAX_TORCH_THREADS || tvlen < 0 || tvlen > MAX_TORCH_VLEN) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw torch_threads must be in [1, %d] and torch_vlen in [0, %d], "
                 "got %d and %d", MAX_TORCH_THREADS, MAX_TORCH_VLEN, tthreads, tvlen);
    return 0;
  }
  if (!parse_state_args(fn, sa, n)) return 0;
  const mp_adamw_param_row *rows = (const mp_adamw_param_row *)ptrs->buf;
  const mp_adamw_hyper_row *hypers = (const mp_adamw_hyper_row *)hyper->buf;
  mp_adamw_coef *coef = c->coef = (mp_adamw_coef *)malloc(sizeof(mp_adamw_coef) * (size_t)(n > 0 ? n : 1));
  if (!coef) {
    PyErr_NoMemory();
    return 0;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    const mp_adamw_param_row *r = &rows[i];
    /* numel in [0, MAX_NUMEL), dtype codes in range, and a row with a grad
     * and elements names its master, exp_avg and exp_avg_sq */
    if (r->numel < 0 || r->numel >= MAX_NUMEL || !mp_dtype_valid(r->grad_dtype) || !mp_dtype_valid(r->param_dtype) ||
        (r->grad != 0 && r->numel > 0 && (r->master == 0 || r->exp_avg == 0 || r->exp_avg_sq == 0))) {
      PyErr_Format(PyExc_ValueError, "moepeak: adamw ptrs row %zd is malformed (numel %lld must be in [0, 2^48), "
                   "dtype codes %lld, %lld in [0, 2], master/exp_avg/exp_avg_sq non-null)", i, (long long)r->numel,
                   (long long)r->grad_dtype, (long long)r->param_dtype);
      return 0;
    }
    /* the state tensors a row with a grad reads are aligned to their dtype (ASan/UBSan-clean loads) */
    const int64_t ss = (int64_t)mp_dtype_bytes(sa->sdt);
    if (r->grad != 0 && r->numel > 0 &&
        (r->exp_avg % ss != 0 || r->exp_avg_sq % ss != 0 || r->max_exp_avg_sq % ss != 0)) {
      PyErr_Format(PyExc_ValueError, "moepeak._C.%s: ptrs row %zd: exp_avg, exp_avg_sq and max_exp_avg_sq must be "
                   "aligned to their dtype's %d bytes (state_dtype %d)", fn, i, (int)ss, sa->sdt);
      return 0;
    }
    const mp_adamw_hyper_row *h = &hypers[i];
    mp_adamw_coef_init(&coef[i], h->lr, h->beta1, h->beta2, h->eps, h->weight_decay, h->step, h->maximize != 0.0);
    mp_adamw_coef_set_tails(&coef[i], r->numel, tthreads, tvlen);
    mp_adamw_coef_set_rounding(&coef[i], row_seed(sa, i), h->step);
  }
  c->n = n;
  return 1;
}

/* adamw_cpu's step on a parsed call: the rows with a grad and elements, run
 * without the GIL. None, or NULL with an exception set. */
static PyObject *run_cpu_step(const step_call *c) {
  mp_adamw_seg *segs = (mp_adamw_seg *)calloc((size_t)(c->n > 0 ? c->n : 1), sizeof(mp_adamw_seg));
  if (!segs) return PyErr_NoMemory();
  int ns = 0;
  const mp_adamw_param_row *rows = (const mp_adamw_param_row *)c->ptrs.buf;
  for (Py_ssize_t i = 0; i < c->n; i++) {
    const mp_adamw_param_row *r = &rows[i];
    if (r->grad == 0 || r->numel == 0) continue; /* no grad / empty */
    mp_adamw_seg s = {.p = (float *)(intptr_t)r->master,
                      .m = (void *)(intptr_t)r->exp_avg,
                      .v = (void *)(intptr_t)r->exp_avg_sq,
                      .vmax = (void *)(intptr_t)r->max_exp_avg_sq,
                      .g = (const void *)(intptr_t)r->grad,
                      .lp = (void *)(intptr_t)r->param_lowp,
                      .n = r->numel,
                      .base = 0,
                      .gdt = (int)r->grad_dtype,
                      .ldt = (int)r->param_dtype,
                      .coef = &c->coef[i],
                      .lp_stream = 0,
                      .sdt = c->sa.sdt};
    segs[ns++] = s;
  }
  mp_status st;
  Py_BEGIN_ALLOW_THREADS st = mp_adamw_run(segs, ns, c->isa, c->threads);
  Py_END_ALLOW_THREADS
  free(segs);
  return mp_return_none(st);
}

/* adamw_cpu(ptrs, hyper, isa, threads, torch_threads, torch_vlen, state_dtype=0, seed=0): every tensor on
 * the CPU, updated in place (the "param" column is the low-precision copy to write, or 0). */
static PyObject *py_adamw_cpu(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"ptrs", "hyper", "isa", "threads", "torch_threads", "torch_vlen", "state_dtype", "seed",
                           NULL};
  step_call c = STEP_CALL_INIT;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*iiii|iO:adamw_cpu", kwlist, &c.ptrs, &c.hyper, &c.isa,
                                   &c.threads, &c.tthreads, &c.tvlen, &c.sa.sdt, &c.sa.seed))
    return NULL;
  PyObject *ret = parse_step("adamw_cpu", &c) ? run_cpu_step(&c) : NULL;
  step_call_release(&c);
  return ret;
}

/* ---------------------------------------------------------------- pipeline
 * `host` plans (tests, any build) run the same schedule on CPU tensors with
 * memcpy in place of the copy engines and no events; CUDA plans need a CUDA
 * build. The wrappers below are the only place that differs. */

typedef struct {
  int64_t nseg, nb, nparam, gslots, pslots;
  int host;            /* 1: memcpy + no events (CPU tensors); 0: CUDA */
  mp_adamw_segment_row *segs; /* [nseg] */
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
  int64_t nseg = segs.len / (Py_ssize_t)sizeof(mp_adamw_segment_row);
  int64_t nb = bseg.len / (Py_ssize_t)sizeof(int64_t) - 1;
  if (segs.len != nseg * (Py_ssize_t)sizeof(mp_adamw_segment_row) || nb < 1 || gslots < 2 || gslots > 64 ||
      pslots < 1 || pslots > 64 || gbytes <= 0 || gbytes >= MAX_BYTES || pbytes <= 0 || pbytes >= MAX_BYTES ||
      nparam < 1 || nparam >= MAX_NUMEL) {
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
  p->segs = (mp_adamw_segment_row *)malloc((size_t)segs.len);
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
    const mp_adamw_segment_row *s = &p->segs[k];
    /* every field bounded: first + numel and grad_slot_offset + 4 * numel cannot overflow */
    if (s->param < 0 || s->param >= nparam || s->first < 0 || s->first >= MAX_NUMEL || s->numel <= 0 ||
        s->numel >= MAX_NUMEL || s->grad_slot_offset < 0 || s->grad_slot_offset >= gbytes ||
        s->param_slot_offset < 0 || s->param_slot_offset >= pbytes) {
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
static mp_status issue_d2h(adamw_plan *p, const mp_adamw_param_row *rows, int64_t b, int64_t slot) {
  mp_status st = MP_OK;
  for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1]; k++) {
    const mp_adamw_segment_row *s = &p->segs[k];
    const mp_adamw_param_row *r = &rows[s->param];
    if (r->grad == 0) continue;
    size_t es = mp_dtype_bytes(r->grad_dtype);
    MP_TRY(st, pl_copy(p, p->gslot[slot] + s->grad_slot_offset, (const char *)(intptr_t)r->grad + (size_t)s->first * es,
                       (size_t)s->numel * es, p->d2h));
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
  return ptr ? (char *)(intptr_t)ptr + (size_t)first * mp_dtype_bytes(sdt) : NULL;
}

static mp_status run_pipeline(adamw_plan *p, const mp_adamw_param_row *rows, const mp_adamw_coef *coef,
                              uintptr_t cur, int isa, int threads, int sdt, int64_t *active) {
  mp_status st = MP_OK;
  int64_t nb = 0;
  for (int64_t b = 0; b < p->nb; b++) {
    int any = 0;
    for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1] && !any; k++) any = rows[p->segs[k].param].grad != 0;
    if (any) active[nb++] = b;
  }
  if (nb == 0) return MP_OK;
  MP_TRY(st, pl_record(p, p->ev_start, cur));
  MP_TRY(st, pl_wait(p, p->d2h, p->ev_start));
  MP_TRY(st, pl_wait(p, p->h2d, p->ev_start));
  for (int64_t j = 0; j < nb && j < p->gslots; j++) MP_TRY(st, issue_d2h(p, rows, active[j], j % p->gslots));
  for (int64_t j = 0; j < nb; j++) {
    int64_t b = active[j], gs = j % p->gslots, ps = j % p->pslots;
    MP_TRY(st, pl_sync(p, p->gev[gs])); /* grads of bucket b are in gslot[gs] */
    MP_TRY(st, pl_sync(p, p->pev[ps])); /* pslot[ps] no longer read by an H2D */
    int ns = 0;
    for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1]; k++) {
      const mp_adamw_segment_row *s = &p->segs[k];
      const mp_adamw_param_row *r = &rows[s->param];
      if (r->grad == 0) continue;
      mp_adamw_seg w = {.p = (float *)(intptr_t)r->master + s->first,
                        .m = state_at(r->exp_avg, s->first, sdt),
                        .v = state_at(r->exp_avg_sq, s->first, sdt),
                        .vmax = state_at(r->max_exp_avg_sq, s->first, sdt),
                        .g = p->gslot[gs] + s->grad_slot_offset,
                        .lp = p->pslot[ps] + s->param_slot_offset,
                        .n = s->numel,
                        .base = s->first,
                        .gdt = (int)r->grad_dtype,
                        .ldt = (int)r->param_dtype,
                        .coef = &coef[s->param],
                        .lp_stream = 1 /* lp: a pinned slot */,
                        .sdt = sdt};
      p->work[ns++] = w;
    }
    MP_TRY(st, mp_adamw_run(p->work, ns, isa, threads));
    for (int64_t k = p->bucket_seg[b]; k < p->bucket_seg[b + 1]; k++) {
      const mp_adamw_segment_row *s = &p->segs[k];
      const mp_adamw_param_row *r = &rows[s->param];
      if (r->grad == 0) continue;
      size_t es = mp_dtype_bytes(r->param_dtype);
      MP_TRY(st, pl_copy(p, (char *)(intptr_t)r->param_lowp + (size_t)s->first * es,
                         p->pslot[ps] + s->param_slot_offset, (size_t)s->numel * es, p->h2d));
    }
    MP_TRY(st, pl_record(p, p->pev[ps], p->h2d));
    if (j + p->gslots < nb) MP_TRY(st, issue_d2h(p, rows, active[j + p->gslots], gs)); /* gslot[gs] is free again */
  }
  MP_TRY(st, pl_wait(p, cur, p->pev[(nb - 1) % p->pslots]));
fail:
  return st;
}

/* adamw_plan_step's step on a parsed call: every segment checked against its
 * parameter and its plan's slots, then the pipeline without the GIL. None, or
 * NULL with an exception set. */
static PyObject *run_plan_step(adamw_plan *p, uintptr_t cur, const step_call *c) {
  if (c->n != p->nparam) {
    PyErr_Format(PyExc_ValueError, "moepeak: adamw_plan_step: plan has %lld params, got %zd", (long long)p->nparam,
                 c->n);
    return NULL;
  }
  /* Every segment must lie inside its parameter and its slots. */
  const mp_adamw_param_row *rows = (const mp_adamw_param_row *)c->ptrs.buf;
  for (int64_t k = 0; k < p->nseg; k++) {
    const mp_adamw_segment_row *s = &p->segs[k];
    const mp_adamw_param_row *r = &rows[s->param];
    if (r->grad == 0) continue; /* no grad this step: skipped, never touched */
    /* overflow-safe: first, numel < 2^48 and the slot offsets < 2^52 (checked at creation / in parse_step) */
    if (s->numel > r->numel || s->first > r->numel - s->numel || r->param_lowp == 0 ||
        s->numel * (int64_t)mp_dtype_bytes(r->grad_dtype) > (int64_t)p->gslot_bytes - s->grad_slot_offset ||
        s->numel * (int64_t)mp_dtype_bytes(r->param_dtype) > (int64_t)p->pslot_bytes - s->param_slot_offset) {
      PyErr_Format(PyExc_ValueError, "moepeak: adamw_plan_step: segment %lld does not fit its param or slot "
                   "(the plan was built for other shapes or dtypes, or the param pointer is null)", (long long)k);
      return NULL;
    }
  }
  int64_t *active = (int64_t *)malloc(sizeof(int64_t) * (size_t)p->nb);
  if (!active) return PyErr_NoMemory();
  mp_status st;
  Py_BEGIN_ALLOW_THREADS st = run_pipeline(p, rows, c->coef, cur, c->isa, c->threads, c->sa.sdt, active);
  Py_END_ALLOW_THREADS
  free(active);
  return mp_return_none(st);
}

/* adamw_plan_step(plan, ptrs, hyper, current_stream, isa, threads, torch_threads, torch_vlen, state_dtype=0,
 * seed=0) */
static PyObject *py_adamw_plan_step(PyObject *self, PyObject *args, PyObject *kwargs) {
  (void)self;
  static char *kwlist[] = {"plan", "ptrs", "hyper", "stream", "isa", "threads", "torch_threads", "torch_vlen",
                           "state_dtype", "seed", NULL};
  PyObject *cap;
  unsigned long long cur;
  step_call c = STEP_CALL_INIT;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oy*y*Kiiii|iO:adamw_plan_step", kwlist, &cap, &c.ptrs, &c.hyper,
                                   &cur, &c.isa, &c.threads, &c.tthreads, &c.tvlen, &c.sa.sdt, &c.sa.seed))
    return NULL;
  adamw_plan *p = (adamw_plan *)PyCapsule_GetPointer(cap, "moepeak.adamw_plan");
  PyObject *ret = p && parse_step("adamw_plan_step", &c) ? run_plan_step(p, (uintptr_t)cur, &c) : NULL;
  step_call_release(&c);
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
