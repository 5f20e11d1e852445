"""The task registry: `make_sample(task, tokenizer, length=..., seed=...)` for every task."""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvjax.eval import aggregation, kv_retrieval, niah, sizing, vt
from kvjax.eval.sample import Sample

# name -> (generator(tokenizer, *, length, seed, **options), whether it takes `depth`)
_TASKS: dict[str, tuple[Callable[..., Sample], bool]] = {
    **{name: (functools.partial(niah.niah, task=name), niah.VARIANTS[name][4] * niah.VARIANTS[name][5] == 1)
       for name in niah.VARIANTS},
    "passkey": (niah.passkey, True),
    "vt": (vt.variable_tracking, False),
    "cwe": (aggregation.common_words, False),
    "fwe": (aggregation.frequent_words, False),
    "kv_retrieval": (kv_retrieval.kv_retrieval, True),
}

# RULER's 13 tasks less its two QA tasks (they need SQuAD / HotpotQA, a download).
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


def task_names() -> tuple[str, ...]:
  return tuple(sorted(_TASKS))


def takes_depth(task: str) -> bool:
  """Whether the task places its answer at a requested depth."""
  _check(task)
  return _TASKS[task][1]


def _check(task: str) -> None:
  if task not in _TASKS:
    raise ValueError(f"unknown {task=}; known: {', '.join(task_names())}")


def make_sample(task: str, tokenizer: sizing.TextTokenizer, *, length: int, seed: int = 0,
                depth: float | None = None, **options) -> Sample:
  """One sample of `task`, its prompt text sized to `length` tokens of `tokenizer`.

  Args:
    task: a name from task_names().
    tokenizer: the model's tokenizer (`model.tokenizer`).
    length: token target of the prompt text (the chat template and answer prefix come on top).
    seed: the sample's seed; (task, length, depth, seed, options) and the tokenizer fix the sample.
    depth: where the answer goes, in [0, 1] (tasks where takes_depth(task)); None: random.
    **options: task-specific options (e.g. num_hops for "vt", tolerance for any task).
  """
  _check(task)
  fn, depth_ok = _TASKS[task]
  if depth is not None:
    if not depth_ok:
      raise ValueError(f"task {task!r} does not place its answer at a depth; give depth=None")
    options["depth"] = depth
  return fn(tokenizer, length=length, seed=seed, **options)
