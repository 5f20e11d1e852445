"""Attention math on the device for kvjax.

Every attention entry point returns flash residuals `(o, lse)`: o normalized
over its own set (float32) and lse the natural-log log-sum-exp of the scaled
scores (float32); an empty set is o = 0, lse = -inf. `merge_partials` is the
only place partials are combined. Each kernel has a float32 `*_reference`
twin with the same signature. This package imports nothing from kvjax,
models or host_index.
"""

from ops.block_neighbours import block_nearest_keys
from ops.key_scores import key_page_scores
from ops.key_scores import key_page_scores_reference
from ops.key_scores import pallas_supported as key_scores_pallas_supported
from ops.merge import merge_partials
from ops.paged_attention import paged_partial_attention
from ops.paged_attention import paged_partial_attention_reference
from ops.partial_attention import partial_attention
from ops.partial_attention import partial_attention_reference
from ops.prefill_attention import prefill_attention
from ops.prefill_attention import prefill_attention_reference
from ops.topk import exact_topk
from ops.topk import exact_topk_reference
from ops.topk import nearest_keys

# `merge` is the name used in DESIGN.md's decode-step sketch.
merge = merge_partials

__all__ = [
    "block_nearest_keys",
    "exact_topk",
    "exact_topk_reference",
    "nearest_keys",
    "key_page_scores",
    "key_page_scores_reference",
    "key_scores_pallas_supported",
    "merge",
    "merge_partials",
    "paged_partial_attention",
    "paged_partial_attention_reference",
    "partial_attention",
    "partial_attention_reference",
    "prefill_attention",
    "prefill_attention_reference",
]
