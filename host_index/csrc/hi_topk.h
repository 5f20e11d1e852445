/* Exact top-k of score rows: each row's k largest entries, as column ids. */
#ifndef HI_TOPK_H
#define HI_TOPK_H

#include <stdint.h>

/* ids[r, 0..k) = the columns of row r of scores [R, N] holding its k largest values, largest
 * first, a tie going to the lower column (a deterministic function of the scores). 0 <= k <= N
 * < 2^31. OpenMP over rows (`threads` as hi_threads; fewer for small inputs). Returns
 * HI_ENONFINITE for a NaN or inf score (ids then undefined), HI_EINVAL for bad sizes. */
int hi_topk_rows(const float *scores, int64_t R, int64_t N, int64_t k, int64_t *ids, int threads);

#endif
