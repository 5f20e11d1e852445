/* hi_select_slots: compose each row's wanted ids and assign them slots, threaded over rows.
 *
 * Membership goes through a bitmap over store ids per thread instead of hi_assign_slots'
 * per-row hash table (filled, probed twice, cleared: 1.1 ms on one core for SmolLM2's 270 rows
 * of 396 slots with 16 pinned spans, this whole routine 0.46 ms): every wanted id lies below its
 * store's length, so a bitmap of a few KiB (tens at 128K tokens) stays in cache, and a row
 * leaves it clear by consuming the bits it set. */
#define _POSIX_C_SOURCE 200809L
#include "hi_slots.h"

#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "hi_attend.h"

enum { KEEP = -2, FREE = -3 }; /* a slot's write: none, or not decided yet */

static int has_bit(const uint64_t *bits, int64_t id) {
  return (int)(bits[id >> 6] >> (id & 63)) & 1;
}

static int any_below(const int64_t *a, int64_t n, int64_t lowest) {
  int below = 0;
  for (int64_t i = 0; i < n; i++) below |= a[i] < lowest; /* no early exit: no branch */
  return below;
}

/* HI_OK when the sizes agree and the layers and store lengths are in range (the rows' ids:
 * rows_valid), else HI_EINVAL (or HI_ENOMEM). */
static int selection_check(const hi_selection_t *sel, int64_t held_rows, int64_t S) {
  const int64_t T = sel->T, B = sel->B, H = sel->H;
  int64_t per_layer, R, cols, extra;
  if (T < 0 || B < 0 || H < 0 || S < 0 || held_rows < 0 || sel->k < 0 || sel->tail < 0 ||
      sel->sources < 0 || sel->sources > sel->k || sel->successors < 0 || sel->pinned < 0 ||
      sel->span < 1 || sel->n_used < 0 || (sel->successors && !sel->age) ||
      (sel->pinned && !sel->pins) || (sel->score && !sel->used) ||
      __builtin_mul_overflow(B, H, &per_layer) || __builtin_mul_overflow(T, per_layer, &R) ||
      __builtin_add_overflow(sel->k, sel->tail, &cols) ||
      __builtin_mul_overflow(sel->sources, sel->successors, &extra) ||
      __builtin_add_overflow(cols, extra, &cols) ||
      __builtin_mul_overflow(sel->pinned, sel->span, &extra) ||
      __builtin_add_overflow(cols, extra, &cols) || cols > S)
    return HI_EINVAL;
  if (R == 0) return HI_OK;
  const int64_t L = held_rows / per_layer;
  uint8_t *taken = calloc((size_t)(L > 0 ? L : 1), 1);
  if (!taken) return HI_ENOMEM;
  int ok = 1;
  for (int64_t t = 0; ok && t < T; t++) { /* distinct layers: no two threads share a row */
    const int64_t l = sel->layers[t];
    ok = l >= 0 && l < L && !taken[l];
    if (ok) taken[l] = 1;
  }
  free(taken);
  return ok && !any_below(sel->stored, T * B, 0) ? HI_OK : HI_EINVAL;
}

/* Whether rows lo..hi-1 hold ids in range: held, pins and used >= -1, found in [-1, stored),
 * seen and age >= 0. */
static int rows_valid(const int64_t *held, int64_t S, const hi_selection_t *sel, int64_t lo,
                      int64_t hi) {
  const int64_t per_layer = sel->B * sel->H, k = sel->k;
  int bad = 0;
  for (int64_t r = lo; r < hi; r++) {
    const int64_t n = sel->stored[r / sel->H], *f = sel->found + r * k;
    bad |= any_below(held + (sel->layers[r / per_layer] * per_layer + r % per_layer) * S, S, -1);
    for (int64_t i = 0; i < k; i++) bad |= f[i] < -1 || f[i] >= n;
    bad |= sel->seen[r] < 0 || (sel->successors && sel->age[r] < 0);
    if (sel->pinned) bad |= any_below(sel->pins + r * sel->pinned, sel->pinned, -1);
    if (sel->score) bad |= any_below(sel->used + r * sel->n_used, sel->n_used, -1);
  }
  return !bad;
}

/* Scores row r (hi_selection_t): adds its valid used ids to *total and those its own selection
 * holds too, among its found ids or in its tail (ids seen .. seen + tail - 1 below n: stored but
 * not yet searchable, as with indexing deferred), to *hits. need (a bitmap over ids below n) is
 * all zero before and after. */
static void score_row(const hi_selection_t *sel, int64_t r, int64_t n, uint64_t *need,
                      int64_t *hits, int64_t *total) {
  const int64_t *f = sel->found + r * sel->k, *u = sel->used + r * sel->n_used, seen = sel->seen[r];
  for (int64_t i = 0; i < sel->k; i++)
    if (f[i] >= 0) need[f[i] >> 6] |= 1ull << (f[i] & 63);
  for (int64_t i = 0; i < sel->n_used; i++) {
    *total += u[i] >= 0;
    *hits += u[i] >= 0 && u[i] < n && (has_bit(need, u[i]) || (u[i] >= seen && u[i] - seen < sel->tail));
  }
  for (int64_t i = 0; i < sel->k; i++) /* every bit set is a found id's */
    if (f[i] >= 0) need[f[i] >> 6] = 0;
}

/* Row r's wanted ids into w[0..S) (hi_selection_t). Differences, not sums, bound each id by
 * n: no sum of a valid id and an offset can overflow. */
static void compose_row(const hi_selection_t *sel, int64_t r, int64_t S, int64_t *w) {
  const int64_t n = sel->stored[r / sel->H], *f = sel->found + r * sel->k, seen = sel->seen[r];
  int64_t j = 0;
  for (int64_t i = 0; i < sel->k; i++) w[j++] = f[i];
  for (int64_t i = 0; i < sel->tail; i++) w[j++] = i < n - seen ? seen + i : -1;
  const int64_t age = sel->successors ? sel->age[r] : 0;
  for (int64_t i = 0; i < sel->sources; i++)
    for (int64_t c = 1; c <= sel->successors; c++)
      w[j++] = f[i] >= 0 && age < n - f[i] - c ? f[i] + age + c : -1;
  const int64_t *p = sel->pinned ? sel->pins + r * sel->pinned : NULL;
  for (int64_t i = 0; i < sel->pinned; i++)
    for (int64_t c = 0; c < sel->span; c++) w[j++] = p[i] >= 0 && c < n - p[i] ? p[i] + c : -1;
  while (j < S) w[j++] = -1;
}

/* out[s] = the write to held slot s that makes h hold the valid ids of w (all below n; held
 * ids at or past n are not wanted), as hi_assign_slots: KEEP (none), FREE (emptied where it
 * holds an id, else none) or the entering id. need (a bitmap over ids) is all zero before and
 * after: it marks the wanted ids no slot holds yet, so a repeated id is kept or placed once. */
static void assign_row(const int64_t *h, const int64_t *w, int64_t S, int64_t n, uint64_t *need,
                       int64_t *out) {
  for (int64_t j = 0; j < S; j++)
    if (w[j] >= 0) need[w[j] >> 6] |= 1ull << (w[j] & 63);
  for (int64_t s = 0; s < S; s++) { /* held ids still wanted stay put */
    const int64_t id = h[s];
    out[s] = FREE;
    if (id >= 0 && id < n && has_bit(need, id)) {
      need[id >> 6] &= ~(1ull << (id & 63));
      out[s] = KEEP;
    }
  }
  int64_t s = 0;
  for (int64_t j = 0; j < S; j++) { /* entering ids take the free slots, first free first */
    const int64_t id = w[j];
    if (id < 0 || !has_bit(need, id)) continue;
    need[id >> 6] &= ~(1ull << (id & 63)); /* every wanted id's bit is cleared by now */
    while (out[s] != FREE) s++;            /* distinct wanted ids <= S: a free slot is left */
    out[s] = id;
  }
}

/* Rows lo..hi-1: scored, composed, assigned and applied to held; their writes go to out's
 * dest, ids, src from index `at` on (returns their number), their scores to *hits, *total. */
static int64_t select_rows(int64_t *held, int64_t S, const hi_selection_t *sel, int64_t lo,
                           int64_t hi, hi_select_out_t *o, int64_t at, uint64_t *need, int64_t *w,
                           int64_t *out, int64_t *hits, int64_t *total) {
  const int64_t per_layer = sel->B * sel->H, head = sel->k + sel->tail;
  int64_t n_writes = 0;
  for (int64_t r = lo; r < hi; r++) {
    const int64_t row = sel->layers[r / per_layer] * per_layer + r % per_layer;
    const int64_t n = sel->stored[r / sel->H];
    int64_t *h = held + row * S;
    if (sel->score && sel->score[r]) score_row(sel, r, n, need, hits, total);
    compose_row(sel, r, S, w);
    if (o->retrieved) memcpy(o->retrieved + r * head, w, (size_t)head * sizeof(int64_t));
    assign_row(h, w, S, n, need, out);
    for (int64_t s = 0; s < S; s++) {
      int64_t id = out[s];
      if (id == KEEP || (id == FREE && h[s] < 0)) continue;
      id = id == FREE ? -1 : id;
      h[s] = id;
      o->dest[at + n_writes] = row * S + s;
      o->ids[at + n_writes] = id;
      o->src[at + n_writes++] = r;
    }
  }
  return n_writes;
}

int hi_select_slots(int64_t *held, int64_t held_rows, int64_t S, const hi_selection_t *sel,
                    hi_select_out_t *o, int threads) {
  o->count = o->hits = o->total = 0;
  const int checked = selection_check(sel, held_rows, S);
  if (checked) return checked;
  const int64_t per_layer = sel->B * sel->H, R = sel->T * per_layer;
  if (R == 0) return HI_OK;
  int64_t most = 1; /* the longest store: the bitmaps' size */
  for (int64_t i = 0; i < sel->T * sel->B; i++)
    if (sel->stored[i] > most) most = sel->stored[i];
  const int64_t words = (most + 63) / 64;
  const int team = hi_team(threads, R, R * S * 8);
  int64_t *starts = calloc((size_t)team, sizeof(int64_t));
  int64_t *counts = calloc((size_t)team, sizeof(int64_t));
  int err = starts && counts ? HI_OK : HI_ENOMEM;
  int64_t hits = 0, total = 0;
  if (!err) {
#pragma omp parallel num_threads(team) reduction(+ : hits, total)
    {
#ifdef _OPENMP
      const int me = omp_get_thread_num(), size = omp_get_num_threads();
#else
      const int me = 0, size = 1;
#endif
      /* Contiguous row ranges in thread order: each thread writes at its range's start
       * (room for S writes a row) and the runs are joined in order below. */
      const int64_t lo = R * me / size, hi = R * (me + 1) / size;
      uint64_t *need = calloc((size_t)words, sizeof(uint64_t));
      int64_t *scratch = malloc((size_t)(2 * (S > 0 ? S : 1)) * sizeof(int64_t));
      const int lerr = !need || !scratch               ? HI_ENOMEM
                       : rows_valid(held, S, sel, lo, hi) ? HI_OK
                                                          : HI_EINVAL;
      if (lerr) {
#pragma omp atomic write
        err = lerr;
      }
#pragma omp barrier /* every row checked before any is rewritten */
      int failed;
#pragma omp atomic read
      failed = err;
      if (!failed) {
        starts[me] = lo * S;
        counts[me] = select_rows(held, S, sel, lo, hi, o, lo * S, need, scratch, scratch + S, &hits,
                                 &total);
      }
      free(need);
      free(scratch);
    }
  }
  if (!err) { /* join the runs: each moves down, to or below where it was written */
    int64_t n = 0;
    for (int i = 0; i < team; i++) {
      memmove(o->dest + n, o->dest + starts[i], (size_t)counts[i] * sizeof(int64_t));
      memmove(o->ids + n, o->ids + starts[i], (size_t)counts[i] * sizeof(int64_t));
      memmove(o->src + n, o->src + starts[i], (size_t)counts[i] * sizeof(int64_t));
      n += counts[i];
    }
    o->count = n;
    o->hits = hits;
    o->total = total;
  }
  free(starts);
  free(counts);
  return err;
}
