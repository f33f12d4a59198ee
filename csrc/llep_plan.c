/* llep_plan.c: the LLEP planner and the pipelined chunk layout.
 *
 * Everything here is integer arithmetic on tables that every rank holds
 * identically (the all-gathered P x E load matrix), so every rank computes the
 * same plan, the same chunk count and the same slices, and issues the same
 * collectives in the same order. A plain-Python rendering lives in
 * tests/refs.py (llep_plan_ref, llep_chunk_layout_ref); the two must agree
 * exactly.
 *
 * Planner (Least-Loaded EP, our own statement of it):
 *   L[e] = sum_s load[s, e]; total = sum_e L[e]; owner(e) = e / (E / P).
 *   No spill (every expert runs on its owner) when P == 1, total == 0, or
 *   max_r native(r) * P < lam * total (max/mean below the threshold).
 *   Otherwise cap = max(1, ceil(alpha * total / P)) rows per rank, and:
 *   1. Native pass, experts by L ascending (ties: lower id first): the owner
 *      keeps min(L, cap - assigned[owner]). Small experts fill their owner
 *      first, so the excess of an overloaded rank is taken from its largest
 *      experts: the fewest experts move. Moving an expert costs its weights
 *      (and their gradient) on the helper whatever its load, so this keeps
 *      the borrowed set -- memory outside the chunk working set -- to the
 *      few hot experts; a plan that spills cold experts whole can borrow
 *      nearly all E/P experts of a rank (docs/notes/llep_history.md).
 *   2. Spill pass, the residuals R[e] > 0 by R descending (ties: lower id):
 *      repeatedly, with d the least-assigned other rank (ties: lower rank):
 *      if R < min_tokens the owner keeps R (a share below min_tokens is
 *      worth neither a GEMM nor a weight transfer); else if d's room >= R
 *      it takes all of R; else if its room >= min_tokens it takes room;
 *      else R goes whole to the least-assigned rank overall (possibly the
 *      owner; the plan is then over capacity, and the chunking still bounds
 *      every chunk by C).
 * Worked example: P = 2, E = 4, loads L = [900, 50, 30, 20] (experts 0-1 on
 *   rank 0, 2-3 on rank 1), alpha = 1, m = 100: total 1000, cap 500. Native
 *   pass: rank 1 keeps 20 + 30; rank 0 keeps 50, then 450 of expert 0.
 *   Spill pass: expert 0's R = 450 >= m, rank 1's room 450 >= R: rank 1
 *   takes it. One expert moves; loads 500 / 500.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "llep.h"

static int argmin_rank(const int64_t *assigned, int P, int exclude) {
  int best = -1;
  for (int d = 0; d < P; d++) {
    if (d == exclude) continue;
    if (best < 0 || assigned[d] < assigned[best]) best = d;
  }
  return best;
}

/* qsort comparator: (key, id) pairs by key descending, then id ascending. */
typedef struct {
  int64_t load;
  int64_t id;
} mp_eload;

static int cmp_eload(const void *a, const void *b) {
  const mp_eload *x = (const mp_eload *)a, *y = (const mp_eload *)b;
  if (x->load != y->load) return x->load > y->load ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

mp_status mp_llep_plan(const int64_t *load, int P, int E, double alpha, int64_t min_tokens, double lam,
                       int64_t *Q, int64_t *A, int64_t *S, int *spilled) {
  mp_status st = MP_OK;
  int64_t *L = NULL, *R = NULL, *assigned = NULL, *nat = NULL;
  mp_eload *order = NULL;
  if (P < 1 || E < 1 || E % P != 0)
    MP_FAIL(st, MP_ERR_INVALID, "llep plan: num_experts (%d) must be a positive multiple of the ranks (%d)", E, P);
  const int El = E / P;
  L = (int64_t *)calloc((size_t)E, sizeof *L);
  R = (int64_t *)calloc((size_t)E, sizeof *R);
  assigned = (int64_t *)calloc((size_t)P, sizeof *assigned);
  nat = (int64_t *)calloc((size_t)P, sizeof *nat);
  order = (mp_eload *)calloc((size_t)E, sizeof *order);
  if (!L || !R || !assigned || !nat || !order) MP_FAIL(st, MP_ERR_NOMEM, "llep plan: out of host memory");
  int64_t total = 0;
  for (int s = 0; s < P; s++)
    for (int e = 0; e < E; e++) {
      if (load[(int64_t)s * E + e] < 0) MP_FAIL(st, MP_ERR_INVALID, "llep plan: negative load at [%d, %d]", s, e);
      L[e] += load[(int64_t)s * E + e];
    }
  int64_t max_nat = 0;
  for (int e = 0; e < E; e++) {
    total += L[e];
    nat[e / El] += L[e];
  }
  for (int r = 0; r < P; r++) max_nat = nat[r] > max_nat ? nat[r] : max_nat;
  memset(Q, 0, sizeof(int64_t) * (size_t)E * (size_t)P);
  *spilled = 0;
  if (P == 1 || total == 0 || (double)max_nat * (double)P < lam * (double)total) {
    for (int e = 0; e < E; e++) Q[(int64_t)e * P + e / El] = L[e];
  } else {
    double capd = ceil(alpha * (double)total / (double)P);
    int64_t cap = capd < 1.0 ? 1 : (capd > 9.0e18 ? (int64_t)9.0e18 : (int64_t)capd);
    /* 1. native pass: L ascending, ties lower id (key -L, sorted descending) */
    for (int e = 0; e < E; e++) {
      order[e].load = -L[e];
      order[e].id = e;
    }
    qsort(order, (size_t)E, sizeof *order, cmp_eload);
    for (int i = 0; i < E; i++) {
      const int e = (int)order[i].id;
      const int o = e / El;
      const int64_t room = cap - assigned[o];
      const int64_t keep = room > 0 ? (room < L[e] ? room : L[e]) : 0;
      Q[(int64_t)e * P + o] = keep;
      assigned[o] += keep;
      R[e] = L[e] - keep;
    }
    /* 2. spill pass: residuals by R descending, ties lower id */
    for (int e = 0; e < E; e++) {
      order[e].load = R[e];
      order[e].id = e;
    }
    qsort(order, (size_t)E, sizeof *order, cmp_eload);
    for (int i = 0; i < E && order[i].load > 0; i++) {
      const int e = (int)order[i].id;
      const int o = e / El;
      int64_t r = R[e];
      while (r > 0) {
        int d = argmin_rank(assigned, P, o);
        const int64_t room = cap - assigned[d];
        int64_t take;
        if (r < min_tokens) {
          d = o;
          take = r;
        } else if (room >= r) {
          take = r;
        } else if (room >= min_tokens && room > 0) {
          take = room;
        } else {
          d = argmin_rank(assigned, P, -1);
          take = r;
        }
        Q[(int64_t)e * P + d] += take;
        assigned[d] += take;
        r -= take;
        if (d != o) *spilled = 1;
      }
    }
  }
  /* Slice each expert's src-major rows into dst segments. */
  memset(A, 0, sizeof(int64_t) * (size_t)E * (size_t)P * (size_t)P);
  memset(S, 0, sizeof(int64_t) * (size_t)P * (size_t)P);
  for (int e = 0; e < E; e++) {
    int64_t src_lo = 0;
    for (int s = 0; s < P; s++) {
      const int64_t src_hi = src_lo + load[(int64_t)s * E + e];
      int64_t seg_lo = 0;
      for (int d = 0; d < P; d++) {
        const int64_t seg_hi = seg_lo + Q[(int64_t)e * P + d];
        const int64_t lo = src_lo > seg_lo ? src_lo : seg_lo;
        const int64_t hi = src_hi < seg_hi ? src_hi : seg_hi;
        if (hi > lo) {
          A[((int64_t)e * P + s) * P + d] = hi - lo;
          S[(int64_t)s * P + d] += hi - lo;
        }
        seg_lo = seg_hi;
      }
      src_lo = src_hi;
    }
  }
fail:
  free(L);
  free(R);
  free(assigned);
  free(nat);
  free(order);
  return st;
}

int64_t mp_llep_num_chunks(const int64_t *S, int P, int64_t C) {
  const int64_t q = C / P;
  int64_t n = 0;
  for (int64_t i = 0; i < (int64_t)P * P; i++) {
    const int64_t c = (S[i] + q - 1) / q;
    n = c > n ? c : n;
  }
  return n;
}

void mp_llep_slice(int64_t Ssd, int64_t n, int64_t j, int64_t *lo, int64_t *hi) {
  /* Ssd * j < 2^63 for any realistic row count (rows < 2^40, chunks < 2^20). */
  *lo = n > 0 ? (Ssd * j) / n : 0;
  *hi = n > 0 ? (Ssd * (j + 1)) / n : 0;
}

/* Buffer orders for chunk j on rank r:
 *  - send list of rank r (built once by the route kernel): dst-major; within
 *    dst d, expert-ascending; within an expert, token order. Pair (r, d)
 *    starts at sum_{d' < d} S[r, d'].
 *  - receive buffer: src-major; src s's rows are slice j of pair (s, r), which
 *    is itself expert-ascending with A[e, s, r] rows per expert.
 *  - grouped buffer (what the expert GEMMs read): expert-ascending, then
 *    src-ascending; perm maps grouped position -> receive position. */
mp_status mp_llep_chunk_layout(const int64_t *A, const int64_t *S, int P, int E, int r, int64_t n, int64_t j,
                               int64_t *send_start, int64_t *send_len, int64_t *recv_len, int64_t *perm,
                               int64_t perm_cap, int64_t *ecount, int64_t *rows) {
  mp_status st = MP_OK;
  int64_t *cnt = NULL, *rstart = NULL;
  if (r < 0 || r >= P || j < 0 || j >= n) MP_FAIL(st, MP_ERR_INVALID, "llep layout: bad rank %d or chunk %lld of %lld",
                                                  r, (long long)j, (long long)n);
  int64_t base = 0;
  for (int d = 0; d < P; d++) {
    int64_t lo, hi;
    mp_llep_slice(S[(int64_t)r * P + d], n, j, &lo, &hi);
    send_start[d] = base + lo;
    send_len[d] = hi - lo;
    base += S[(int64_t)r * P + d];
  }
  /* cnt[s*E + e]: rows of expert e from src s in this chunk; rstart: where
   * they begin in the receive buffer. */
  cnt = (int64_t *)calloc((size_t)P * (size_t)E, sizeof *cnt);
  rstart = (int64_t *)calloc((size_t)P * (size_t)E, sizeof *rstart);
  if (!cnt || !rstart) MP_FAIL(st, MP_ERR_NOMEM, "llep layout: out of host memory");
  int64_t roff = 0;
  for (int s = 0; s < P; s++) {
    int64_t lo, hi;
    mp_llep_slice(S[(int64_t)s * P + r], n, j, &lo, &hi);
    recv_len[s] = hi - lo;
    int64_t eoff = 0; /* start of expert e within pair (s, r) */
    for (int e = 0; e < E; e++) {
      const int64_t a = A[((int64_t)e * P + s) * P + r];
      const int64_t x0 = lo > eoff ? lo : eoff;
      const int64_t x1 = hi < eoff + a ? hi : eoff + a;
      if (x1 > x0) {
        cnt[(int64_t)s * E + e] = x1 - x0;
        rstart[(int64_t)s * E + e] = roff + (x0 - lo);
      }
      eoff += a;
    }
    roff += hi - lo;
  }
  if (roff > perm_cap) MP_FAIL(st, MP_ERR_INVALID, "llep layout: %lld rows exceed the chunk budget %lld",
                               (long long)roff, (long long)perm_cap);
  int64_t g = 0;
  for (int e = 0; e < E; e++) {
    ecount[e] = 0;
    for (int s = 0; s < P; s++) {
      const int64_t c = cnt[(int64_t)s * E + e];
      if (perm)
        for (int64_t i = 0; i < c; i++) perm[g++] = rstart[(int64_t)s * E + e] + i;
      ecount[e] += c;
    }
  }
  *rows = roff;
fail:
  free(cnt);
  free(rstart);
  return st;
}
