"""experiments/context_reuse.py: a retrieval context is saved for later rows only when asked."""

import os
import sys

import kvjax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
from context_reuse import ContextReuse  # noqa: E402


def _get_twice(monkeypatch, save: bool):
  saved, built = [], []
  monkeypatch.setattr(kvjax, "save_context", lambda context, path: saved.append(context))
  monkeypatch.setattr(kvjax, "load_context", lambda path, model, policy_options: ("loaded", path))
  reuse = ContextReuse(save=save)
  try:
    first = reuse.get(None, "retrieval", {"index": "flat"}, ("case",), lambda: built.append(1) or "built")
    second = reuse.get(None, "retrieval", {"index": "flat", "speculative": True}, ("case",),
                       lambda: built.append(2) or "built again")
  finally:
    reuse.close()
  return saved, built, first[0], second[0]


def test_saves_and_reloads_a_retrieval_context_when_rows_can_share_it(monkeypatch):
  saved, built, first, second = _get_twice(monkeypatch, save=True)
  assert saved == ["built"] and built == [1]
  assert first == "built" and second[0] == "loaded"  # speculative is a decode option: same build


def test_without_saving_each_row_builds_its_own(monkeypatch):
  saved, built, first, second = _get_twice(monkeypatch, save=False)
  assert saved == [] and built == [1, 2]
  assert (first, second) == ("built", "built again")
