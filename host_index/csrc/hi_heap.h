/* Binary heaps of (distance, id) pairs: a bounded max-heap keeps the best
 * results seen so far, a min-heap holds the frontier of a best-first search.
 * Ties break on id so results are a deterministic function of the inputs. */
#ifndef HI_HEAP_H
#define HI_HEAP_H

#include <stdint.h>

typedef struct {
  float d;
  int32_t id;
} hi_pair;

static inline int hi_pair_lt(hi_pair a, hi_pair b) {
  return a.d < b.d || (a.d == b.d && a.id < b.id);
}

/* Max-heap (largest distance at h[0]). */
static inline void hi_maxheap_push(hi_pair *h, int64_t *n, hi_pair x) {
  int64_t i = (*n)++;
  while (i > 0) {
    int64_t p = (i - 1) / 2;
    if (!hi_pair_lt(h[p], x)) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = x;
}

static inline void hi_maxheap_sift_down(hi_pair *h, int64_t n, int64_t i) {
  hi_pair x = h[i];
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && hi_pair_lt(h[c], h[c + 1])) c++;
    if (!hi_pair_lt(x, h[c])) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = x;
}

static inline hi_pair hi_maxheap_pop(hi_pair *h, int64_t *n) {
  hi_pair top = h[0];
  h[0] = h[--(*n)];
  if (*n > 0) hi_maxheap_sift_down(h, *n, 0);
  return top;
}

/* Keep the cap smallest pairs: push x if there is room or x beats the worst. */
static inline void hi_maxheap_offer(hi_pair *h, int64_t *n, int64_t cap, hi_pair x) {
  if (*n < cap) {
    hi_maxheap_push(h, n, x);
  } else if (cap > 0 && hi_pair_lt(x, h[0])) {
    h[0] = x;
    hi_maxheap_sift_down(h, *n, 0);
  }
}

/* Sort a max-heap in place into ascending order (heap sort). */
static inline void hi_maxheap_sort(hi_pair *h, int64_t n) {
  while (n > 1) {
    hi_pair top = h[0];
    h[0] = h[n - 1];
    n--;
    hi_maxheap_sift_down(h, n, 0);
    h[n] = top;
  }
}

/* Min-heap (smallest distance at h[0]). */
static inline void hi_minheap_push(hi_pair *h, int64_t *n, hi_pair x) {
  int64_t i = (*n)++;
  while (i > 0) {
    int64_t p = (i - 1) / 2;
    if (!hi_pair_lt(x, h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = x;
}

static inline hi_pair hi_minheap_pop(hi_pair *h, int64_t *n) {
  hi_pair top = h[0];
  hi_pair x = h[--(*n)];
  int64_t i = 0;
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && hi_pair_lt(h[c + 1], h[c])) c++;
    if (!hi_pair_lt(h[c], x)) break;
    h[i] = h[c];
    i = c;
  }
  if (*n > 0) h[i] = x;
  return top;
}

#endif
