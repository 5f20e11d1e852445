/* Layer-wide work over (sequence, head), threaded and GIL-free: host partial
 * attention over retrieved or given keys, searches, inserts, and page gathers
 * for FreeKV. */
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

/* The search half of hi_attend: ids [B, Hq, k] (best first, -1 padded) and
 * scanned [B, Hq]. mask [B, Hq] (nonzero = search) or NULL for all; a masked
 * out head gets ids -1 and scanned 0. */
int hi_search_layer(hi_index_t *const *idx, const hi_keys_t *keys, int B, int Hq, int Hkv,
                    int per_q, const float *q, int k, int ef, const uint8_t *mask,
                    int64_t *ids_out, int64_t *scanned, int threads);

/* The attention half of hi_attend over given ids [B, Hq, n]: for each (b, h),
 * softmax of scale * q.k over the keys keys[b * Hkv + h / G] with ids in
 * [0, nrows) (others, e.g. -1, are skipped; a repeated id counts each time)
 * and the weighted sum of vals[b * Hkv + h / G]. o and lse as in hi_attend. */
int hi_attend_ids(const hi_keys_t *keys, const hi_keys_t *vals, int B, int Hq, int Hkv,
                  const float *q, const int64_t *ids, int64_t n, float scale, float *o,
                  float *lse, int threads);

/* Extends count indexes, one task per index, each under its write lock:
 * index i gets keys keys[i] up to row n_total[i]. queries[i] (or NULL) holds
 * the own queries of rows q_start[i] .. q_start[i] + q_rows[i] - 1 (roar
 * links a new key through them); rows below q_start[i] not yet indexed are
 * indexed first without queries. ef: the graph inserts' candidate list (0: each
 * index's own ef_insert). The indexes must be distinct. With yield,
 * each task first waits for running foreground calls (hi_gate.h); the waits,
 * summed over the threads, go to *waited_ns (when not NULL). */
int hi_insert_many(hi_index_t *const *idx, const hi_keys_t *keys, const int64_t *n_total,
                   const int64_t *q_start, const float *const *queries, const int64_t *q_rows,
                   int64_t count, int ef, int threads, int yield, int64_t *waited_ns);

/* out_k[p], out_v[p] ([page, dim] each) = rows page_ids[p] * page .. + page - 1 of head
 * heads[p] of store g = group[p]: k[g] / v[g] ([Hkv, cap[g], dim] in one dtype, len[g] rows
 * stored); rows at or past len[g] are zero-filled, and page_ids[p] == -1 gives a zero page.
 * One parallel loop over all pages, so a step's recall from every (sequence, layer) costs
 * one call; page = 1 gathers single rows (retrieval's selected tokens). Any group, head or
 * other page out of range is HI_EINVAL (nothing copied). */
int hi_gather_pages_multi(const void *const *k, const void *const *v, const int64_t *cap,
                          const int64_t *len, int64_t G, int dtype, int Hkv, int dim, int page,
                          const int64_t *group, const int64_t *heads, const int64_t *page_ids,
                          int64_t P, void *out_k, void *out_v, int threads);

/* Slot writes that make each row r < R of held ([R, S] store ids, -1 = empty)
 * hold the valid ids of the same row of wanted ([R, S], -1 = none): writes[r, s]
 * = -2 (untouched: empty and staying so, or holding an id still wanted), -1
 * (emptied), or the id entering slot s. Entering ids take free slots in slot
 * order, in the order they appear in wanted; a repeated id counts once. Ids
 * below -1 are HI_EINVAL (nothing written). */
int hi_assign_slots(const int64_t *held, const int64_t *wanted, int64_t R, int64_t S, int64_t *writes,
                    int threads);

/* counts[r] = how many valid entries of row r of a ([R, n] ids, -1 = none) occur in
 * row r of b ([R, m], -1 = none); a repeated entry of a counts each time. Ids below
 * -1 are HI_EINVAL. */
int hi_count_common(const int64_t *a, int64_t n, const int64_t *b, int64_t m, int64_t R, int64_t *counts,
                    int threads);

/* Threads for `tasks` independent tasks of about `work` scalar operations in
 * all: at most the requested count (hi_threads), the task count, and one per
 * HI_MIN_WORK operations, so small calls skip the cost of waking a team. */
#define HI_MIN_WORK 65536
int hi_team(int requested, int64_t tasks, int64_t work);

#endif
