/* A slot buffer's selection step in one GIL-free call: each row's wanted ids composed from
 * its search result, its tail, the successors of its best ids and pinned spans, and the slot
 * writes that make the row's held slots hold them (hi_assign_slots' rules). */
#ifndef HI_SLOTS_H
#define HI_SLOTS_H

#include "hi_common.h"

/* The wanted ids of R = T * B * H rows, row r = (t * B + b) * H + h, with n = stored[t * B + b]:
 *   found[r, 0..k)                               its search result (-1 = none; ids < n);
 *   seen[r] + i for i < tail, where < n          the tokens stored after that search's index;
 *   found[r, j] + age[r] + c for j < sources,    the successors of its best ids
 *     c = 1..successors, where found >= 0 and < n;
 *   pins[r, j] + c for j < pinned, c < span,     its pinned spans
 *     where pins >= 0 and < n;
 * in that order, -1 for each absent one, then -1 up to the row's S slots. */
typedef struct {
  int64_t T, B, H;
  const int64_t *layers; /* [T] distinct: row r is row (layers[t] * B + b) * H + h of held */
  const int64_t *stored; /* [T * B] >= 0 */
  const int64_t *found;  /* [R, k] in [-1, stored) */
  int64_t k;
  const int64_t *seen; /* [R] >= 0 */
  int64_t tail;
  const int64_t *age; /* [R] >= 0; NULL when successors == 0 */
  int64_t sources, successors; /* sources <= k */
  const int64_t *pins;         /* [R, pinned] >= -1; NULL when pinned == 0 */
  int64_t pinned, span;
  /* Scoring (optional): for each row with score[r] != 0, the valid ids of used[r] (an earlier
   * selection) and how many of them are among found[r] (a repeated one counts each time). */
  const uint8_t *score; /* [R] or NULL: nothing scored */
  const int64_t *used;  /* [R, n_used] >= -1 */
  int64_t n_used;
} hi_selection_t;

typedef struct {
  int64_t *dest, *ids, *src; /* room for R * S each */
  int64_t *retrieved;        /* [R, k + tail] or NULL */
  int64_t count;             /* entries written to dest, ids, src */
  int64_t hits, total;       /* scoring: used ids found, used ids */
} hi_select_out_t;

/* Rewrites held ([held_rows, S] store ids, -1 = empty; S >= k + tail + sources * successors
 * + pinned * span) in place so that each composed row holds the valid ids of its wanted ids
 * (sel), as hi_assign_slots does: held ids still wanted keep their slot, entering ids take the
 * free slots in slot order, in their wanted order, a repeated id counts once, free slots left
 * over are emptied; rows of held outside sel are not read. Writes out->dest, ids and src
 * [out->count]: the flat index into held of each rewritten slot, the id it now holds (-1 =
 * emptied) and its composed row r, in row then slot order (dest increasing when layers
 * increase); out->retrieved unless NULL: each row's first k + tail wanted ids; out->hits and
 * out->total (sel's scoring). A value out of range (held ids, pins or used ids below -1, found
 * ids outside [-1, stored), negative seen, stored or age) is HI_EINVAL, nothing written. */
int hi_select_slots(int64_t *held, int64_t held_rows, int64_t S, const hi_selection_t *sel,
                    hi_select_out_t *out, int threads);

#endif
