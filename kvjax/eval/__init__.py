"""Offline long-context evaluation: synthetic tasks (RULER, InfiniteBench kv retrieval, the
needle grid, the pass key), their scorers, and a runner that decodes them under each policy.

    from kvjax import eval as kveval
    sample = kveval.make_sample("niah_single_2", model.tokenizer, length=4096, depth=0.5)
    records = kveval.run_sample(model, sample, [kveval.PolicySpec("full"), kveval.PolicySpec("freekv")])

Every task is generated locally and deterministically from a seed (nothing is downloaded).
"""

from kvjax.eval.context_store import ContextStore, StoredContext
from kvjax.eval.paired import PairedLoss, compare_to_reference, disagreeing_seeds, paired_loss
from kvjax.eval.runner import PolicySpec, prompt_ids, run_sample, run_samples
from kvjax.eval.sample import Sample
from kvjax.eval.scoring import kv_exact, score, string_match_all, string_match_part
from kvjax.eval.tasks import RULER_TASKS, make_sample, takes_depth, task_names

__all__ = [
    "RULER_TASKS",
    "ContextStore",
    "PairedLoss",
    "PolicySpec",
    "Sample",
    "StoredContext",
    "compare_to_reference",
    "disagreeing_seeds",
    "kv_exact",
    "make_sample",
    "paired_loss",
    "prompt_ids",
    "run_sample",
    "run_samples",
    "score",
    "string_match_all",
    "string_match_part",
    "takes_depth",
    "task_names",
]
