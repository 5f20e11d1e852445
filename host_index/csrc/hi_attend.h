/* Host partial attention over retrieved keys, and page gathers for FreeKV. */
#ifndef HI_ATTEND_H
#define HI_ATTEND_H

#include "hi_index.h"

/* For each (b, h) of B sequences x Hq query heads: search the index
 * idx[b * Hidx + (per_q ? h : h / G)] (G = Hq / Hkv) with q[b, h] over the keys
 * keys[b * Hkv + h / G], softmax of scale * q.k over the retrieved set and the
 * weighted sum of vals[b * Hkv + h / G]. Writes o [B, Hq, dim] (normalized over
 * the set), lse [B, Hq] (natural log; -inf and o = 0 for an empty set),
 * scanned [B, Hq] and, when ids_out is not NULL, ids [B, Hq, k].
 * Takes each index's read lock around its search. */
int hi_attend(hi_index_t *const *idx, const hi_keys_t *keys, const hi_keys_t *vals, int B,
              int Hq, int Hkv, int per_q, const float *q, int k, int ef, float scale,
              float *o, float *lse, int64_t *scanned, int64_t *ids_out, int threads);

/* out_k[p], out_v[p] ([page, dim] each) = rows page_ids[p] * page ... + page - 1
 * of head heads[p] of k / v ([Hkv, cap, dim] in one dtype); rows at or past
 * len are zero-filled. */
int hi_gather_pages(const void *k, const void *v, int dtype, int Hkv, int64_t cap,
                    int64_t len, int dim, int page, const int64_t *heads,
                    const int64_t *page_ids, int64_t P, void *out_k, void *out_v,
                    int threads);

#endif
