/* llep.h: PipelinedLLEP's C pieces (planner, chunk layout, CPU kernels) and
 * the extern "C" CUDA launchers of cuda/llep.cu. Integer tables are int64,
 * row-major; shapes are given as [dims]. */
#ifndef MOEPEAK_LLEP_H
#define MOEPEAK_LLEP_H
#include "moepeak.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- planner (llep_plan.c) ------------------------------------------------
 * load [P, E]: rows rank s routes to expert e. Expert e is owned by rank
 * e / (E / P). Outputs:
 *   Q [E, P]    rows of expert e that run on rank d,
 *   A [E, P, P] rows of expert e sent from src s to dst d,
 *   S [P, P]    rows sent from s to d (sum over e of A),
 *   *spilled    1 when any row runs away from its owner.
 * Slicing rule for A: expert e's rows are laid out src-major (rank 0's rows in
 * its token order, then rank 1's, ...), and cut into consecutive dst segments
 * of Q[e, 0], Q[e, 1], ... rows; A[e, s, d] is the overlap of src s's range
 * with dst d's segment. */
mp_status mp_llep_plan(const int64_t *load, int P, int E, double alpha, int64_t min_tokens, double lam,
                       int64_t *Q, int64_t *A, int64_t *S, int *spilled);

/* Chunk count: q = floor(C / P) rows per (src, dst) pair and chunk;
 * n = max over pairs of ceil(S[s, d] / q). */
int64_t mp_llep_num_chunks(const int64_t *S, int P, int64_t C);

/* Rows [lo, hi) of pair (s, d) in chunk j of n: the j-th proportional slice
 * [floor(j*S/n), floor((j+1)*S/n)), at most ceil(S/n) <= q rows. */
void mp_llep_slice(int64_t Ssd, int64_t n, int64_t j, int64_t *lo, int64_t *hi);

/* Layout of chunk j on rank r (see llep_plan.c for the buffer orders).
 *   send_start [P], send_len [P]: rank r's rows for dst d in this chunk are
 *     send_index[send_start[d] : +send_len[d]] (send list is dst-major);
 *   recv_len [P]: rows arriving from src s (receive buffer is src-major);
 *   perm [rows]: grouped position g takes receive row perm[g]; grouped order
 *     is expert-ascending, then src-ascending (NULL: not written; one rank
 *     needs none, its receive rows are its send rows);
 *   ecount [E]: grouped rows of expert e in this chunk;
 *   *rows: total received rows (<= P*q <= C; more than perm_cap is refused). */
mp_status mp_llep_chunk_layout(const int64_t *A, const int64_t *S, int P, int E, int r, int64_t n, int64_t j,
                               int64_t *send_start, int64_t *send_len, int64_t *recv_len, int64_t *perm,
                               int64_t perm_cap, int64_t *ecount, int64_t *rows);

/* ---- CPU kernels (llep.c) ------------------------------------------------- */
/* cnt [E + 1]: cnt[e] = #ids == e; cnt[E] = #ids outside [0, E). */
void mp_llep_count_cpu(const int64_t *ids, int64_t n, int E, int64_t *cnt);

/* Stable counting sort of flat (t, k) indices into rank r's dst-major send
 * list: out[blk[e*P+d] + p - cum[e*P+d]] = i for the p-th (in order) id i of
 * expert e, where d is the segment with cum[e*P+d] <= p < cum + Ar[e*P+d]. */
mp_status mp_llep_route_cpu(const int64_t *ids, int64_t n, int E, int P, const int64_t *Ar, const int64_t *cum,
                            const int64_t *blk, int64_t *out);


/* Scaled row gather: out[i, h] = src[idx[i] / div, h] * scale[i] for i < rows,
 * h < N; src, out of one float dtype (mp_dtype, mp_abi.h), scale fp32. Each element is
 * the fp32 product of the element (widened) and scale[i], rounded once to
 * nearest even: the value torch's `rows * scale[:, None]` (bf16/fp16 rows,
 * fp32 scale, stored in the rows' dtype) gives. The CPU version is in llep.c. */

/* SwiGLU over rows of h = [gate | up] (llep_swiglu.c: the arithmetic, torch's op
 * for op; cuda/llep.cu: the same on the GPU). h [rows, ldh] (gate columns [0, I),
 * up [I, 2I)); a, s, da [rows, I] contiguous; dh [rows, ldd] (may be h itself).
 *   fwd: s = rnd(silu(g)) (stored when s != NULL), a = rnd(s * u);
 *   bwd: dh's up half = rnd(da * s), its gate half = silu'(g) applied to
 *        rnd(da * u) as aten silu_backward does. */
typedef struct {
  const void *h;
  int64_t ldh;
  void *a, *s;      /* fwd outputs (s optional); bwd: s read */
  const void *da;   /* bwd */
  void *dh;         /* bwd */
  int64_t ldd, rows, I;
  int dtype;
} mp_llep_swiglu_args;
/* Rows [b, e) of the CPU passes (mp_python.h's parallel-for ranges; ctx: the args). */
void mp_llep_swiglu_fwd_range(void *args, int64_t b, int64_t e, int worker);
void mp_llep_swiglu_bwd_range(void *args, int64_t b, int64_t e, int worker);

/* Down projection's backward epilogue, one pass over a chunk's rows r < rows.
 * In: D [rows, I] = (wp * dy) W_down^T (GEMM output), a [rows, I] = silu(gate)
 * * up, w [rows] the pick weights, wp [rows] the weights dy was scaled by
 * (wp = w, or 1 where |w| is too small to divide by). Out:
 *   dwr[r] = <D[r], a[r]> / wp[r]       (= <dy, a W_down>: d(pick weight), fp32 sum)
 *   D[r] *= w[r] / wp[r], a[r] *= w[r] / wp[r]   (in place; rows with wp == w
 *                                                 are untouched: factor 1)
 * so that afterwards D = da = (w dy) W_down^T and a^T (wp dy) = the true
 * dW_down contribution, without recomputing o = a W_down. dtype: an mp_dtype. */

#if MP_WITH_CUDA
/* ---- CUDA launchers (cuda/llep.cu) ------------------------------------- */
mp_status mp_llep_count_cuda(const int64_t *ids, int64_t n, int E, int64_t *cnt, uintptr_t stream);
mp_status mp_llep_route_cuda(const int64_t *sorted_pos, const int64_t *sorted_ids, int64_t n, int E, int P,
                             const int64_t *tables /* [4, E*P]: Ar, cum, blk, estart (first E) */,
                             int64_t *out, uintptr_t stream);
mp_status mp_llep_gather_cuda(const void *src, const int64_t *idx, int64_t rows, int64_t div, int64_t row_bytes,
                              void *out, uintptr_t stream);
mp_status mp_llep_gather_scaled_cuda(const void *src, const int64_t *idx, const float *scale, int64_t rows,
                                     int64_t div, int64_t N, int dtype, void *out, uintptr_t stream);
mp_status mp_llep_swiglu_fwd_cuda(const mp_llep_swiglu_args *args, uintptr_t stream);
mp_status mp_llep_swiglu_bwd_cuda(const mp_llep_swiglu_args *args, uintptr_t stream);
mp_status mp_llep_combine_cuda(float *acc, const void *y, int dtype, const int64_t *idx, const float *w,
                               int64_t rows, int64_t div, int64_t H, uintptr_t stream);
mp_status mp_llep_down_bwd_cuda(void *D, void *a, int dtype, const float *w, const float *wp, float *dwr,
                                int64_t rows, int64_t I, uintptr_t stream);
#endif

#ifdef __cplusplus
}
#endif
#endif
