/* hi_topk_rows: each row scanned once against a threshold, candidates kept in a small buffer.
 *
 * A score enters the buffer only if it beats the k-th best kept so far (one test per 16 scores
 * passes most of a row); a full buffer keeps its best k (a quickselect), and the k found are
 * sorted at the end. On one dev-box core (k = 100): 33 us a row of 8,000 scores, 58 us a row of
 * 32,000, so ~1 ns a scanned score plus ~25 us a row for the buffer's selections and the sort
 * (a bounded heap, which sifts down at every entry, took 36 us a row of 8,000). */
#define _POSIX_C_SOURCE 200809L
#include "hi_topk.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "hi_attend.h"
#include "hi_common.h"
#include "hi_heap.h"

/* Better = larger score, then lower column: hi_pair_lt on (-score, column). */
typedef hi_pair cand_t;

static inline void swap(cand_t *a, cand_t *b) {
  const cand_t t = *a;
  *a = *b;
  *b = t;
}

/* Reorders c[0..n) so that c[0..k) are its k best (in no order), 0 < k < n. */
static void keep_best(cand_t *c, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2; /* median of three as the pivot, moved to hi */
    if (hi_pair_lt(c[mid], c[lo])) swap(&c[mid], &c[lo]);
    if (hi_pair_lt(c[hi], c[lo])) swap(&c[hi], &c[lo]);
    if (hi_pair_lt(c[mid], c[hi])) swap(&c[mid], &c[hi]);
    const cand_t pivot = c[hi];
    int64_t store = lo;
    for (int64_t i = lo; i < hi; i++)
      if (hi_pair_lt(c[i], pivot)) swap(&c[i], &c[store++]);
    swap(&c[store], &c[hi]); /* the pivot's final rank */
    if (store == k - 1 || store == k) return;
    if (store < k) lo = store + 1;
    else hi = store - 1;
  }
}

/* One row into out[0..k); buf holds 4k candidates. 0 < k <= N. */
static int topk_row(const float *s, int64_t N, int64_t k, cand_t *buf, int64_t *out) {
  const int64_t cap = 4 * k;
  int64_t n = 0;
  float threshold = -INFINITY; /* a score must beat it: the k-th best kept once n reached k */
  int bad = 0;
  for (int64_t start = 0; start < N; start += 16) {
    const int64_t end = start + 16 < N ? start + 16 : N;
    int any = 0;
    for (int64_t j = start; j < end; j++) {
      bad |= !(fabsf(s[j]) <= FLT_MAX); /* NaN or inf */
      any |= s[j] > threshold;
    }
    if (!any && n >= k) continue;
    for (int64_t j = start; j < end; j++) {
      if (n >= k && !(s[j] > threshold)) continue; /* a tie with the k-th loses: a higher column */
      buf[n++] = (cand_t){-s[j], (int32_t)j};
      if (n == cap) {
        keep_best(buf, n, k);
        n = k;
        float worst = buf[0].d;
        for (int64_t i = 1; i < k; i++) worst = buf[i].d > worst ? buf[i].d : worst;
        threshold = -worst;
      }
    }
  }
  if (bad) return HI_ENONFINITE;
  if (n > k) keep_best(buf, n, k);
  /* sort the k best: heap sort of the pairs, ascending (-score, column) = best first */
  int64_t m = 0;
  for (int64_t i = 0; i < k; i++) hi_maxheap_push(buf + cap, &m, buf[i]);
  hi_maxheap_sort(buf + cap, m);
  for (int64_t i = 0; i < k; i++) out[i] = buf[cap + i].id;
  return HI_OK;
}

int hi_topk_rows(const float *scores, int64_t R, int64_t N, int64_t k, int64_t *ids, int threads) {
  if (R < 0 || k < 0 || k > N || N > INT32_MAX) return HI_EINVAL;
  if (R == 0 || k == 0) {
    for (int64_t i = 0; i < R * N; i++) /* still refuse non-finite scores */
      if (!(fabsf(scores[i]) <= FLT_MAX)) return HI_ENONFINITE;
    return HI_OK;
  }
  int err = HI_OK;
#pragma omp parallel num_threads(hi_team(threads, R, R * N * 4))
  {
    cand_t *buf = malloc((size_t)(5 * k) * sizeof(cand_t)); /* 4k candidates, then k to sort */
    if (!buf) {
#pragma omp atomic write
      err = HI_ENOMEM;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) {
      if (!buf) continue;
      if (topk_row(scores + r * N, N, k, buf, ids + r * k) != HI_OK) {
#pragma omp atomic write
        err = HI_ENONFINITE;
      }
    }
    free(buf);
  }
  return err;
}
