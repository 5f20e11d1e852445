"""kvjax.eval.ContextStore: contexts prefilled once, saved, and reloaded by later runs (CPU, random:tiny)."""

import dataclasses
import json

import pytest
from byte_tokenizer import byte_tokenizer

import kvjax
from kvjax import eval as kveval

RETRIEVAL = {"index": "flat", "topk": 16, "sinks": 16, "window": 64}


@pytest.fixture(scope="module")
def model():
  return dataclasses.replace(kvjax.load_model("random:tiny"), tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def sample(model):
  return kveval.make_sample("niah_single_1", model.tokenizer, length=700, seed=0, depth=0.5)


def _specs():
  return [kveval.PolicySpec("full"), kveval.PolicySpec("retrieval", RETRIEVAL, label="retrieval"),
          kveval.PolicySpec("retrieval", RETRIEVAL | {"speculative": True, "topk": 8}, label="speculative")]


def test_a_stored_context_decodes_as_a_fresh_prefill(model, sample, tmp_path):
  fresh = kveval.run_sample(model, sample, _specs(), max_new_tokens=4)
  store = kveval.ContextStore(tmp_path / "store", made_by="commit-a")
  first = kveval.run_sample(model, sample, _specs(), max_new_tokens=4, contexts=store)
  # One saved context per prefill group (full; the two retrieval specs differ in decode options only).
  assert len(list((tmp_path / "store").iterdir())) == 2
  assert [r["context_loaded"] for r in first] == [False] * 3
  later = kveval.ContextStore(tmp_path / "store", made_by="commit-b")  # a later run, other code
  second = kveval.run_sample(model, sample, _specs(), max_new_tokens=4, contexts=later)
  assert [r["context_loaded"] for r in second] == [True] * 3
  assert all(r["context_made_by"] == "commit-a" and r["context_load_seconds"] > 0 for r in second)
  # The group's prefill time is the one its maker measured, not the load's.
  assert [r["prefill_seconds"] for r in second] == [r["prefill_seconds"] for r in first]
  # Token for token what a fresh prefill decodes, each spec with its own decode options.
  assert [r["generated"] for r in first] == [r["generated"] for r in second] == [r["generated"] for r in fresh]
  counts = ("searched_heads", "scanned", "corrected_groups")  # each spec searched as its own options say
  assert [[r["policy_stats"].get(c) for c in counts] for r in second] == [
      [r["policy_stats"].get(c) for c in counts] for r in fresh]
  assert second[1]["policy_stats"]["correction_rate"] is None and second[2]["policy_stats"]["correction_rate"] == 1.0
  # Loaded by a spec with other decode options than the one that saved it: its own options hold.
  (speculative,) = kveval.run_sample(model, sample, _specs()[2:], max_new_tokens=4, contexts=later)
  assert speculative["context_loaded"] and speculative["policy_stats"]["correction_rate"] == 1.0
  assert speculative["generated"] == fresh[2]["generated"]
  assert len(list((tmp_path / "store").iterdir())) == 2


def test_the_key_holds_what_shapes_the_context(model, sample, tmp_path):
  store = kveval.ContextStore(tmp_path)
  ids = kveval.prompt_ids(model.tokenizer, sample)
  base = dict(max_new_tokens=4, prefill_chunk=1024)
  path = lambda ids, policy, options, **kw: store.path(store.key(model, ids, policy, options, **(base | kw)))
  reference = path(ids, "retrieval", RETRIEVAL)
  # Decode options (top-k, speculation, tau) share the context ...
  assert path(ids, "retrieval", RETRIEVAL | {"topk": 8, "speculative": True, "tau": 0.9}) == reference
  # ... and naming a default changes nothing, as the key holds resolved options.
  assert path(ids, "retrieval", {"index": "flat", "sinks": 128}) == path(ids, "retrieval", {"index": "flat"})
  others = [path(ids[:-1], "retrieval", RETRIEVAL), path(ids, "retrieval", RETRIEVAL | {"window": 128}),
            path(ids, "retrieval", RETRIEVAL | {"index": "ivf"}), path(ids, "full", {}),
            path(ids, "retrieval", RETRIEVAL, max_new_tokens=8), path(ids, "retrieval", RETRIEVAL, prefill_chunk=256)]
  assert len({reference, *others}) == 1 + len(others)
  assert reference.name.startswith(f"retrieval-{len(ids)}-")


def test_a_context_that_no_longer_loads_is_prefilled_again(model, sample, tmp_path, caplog):
  specs = _specs()[:1]
  store = kveval.ContextStore(tmp_path, made_by="a")
  kveval.run_sample(model, sample, specs, max_new_tokens=4, contexts=store)
  (saved,) = tmp_path.iterdir()
  manifest = json.loads((saved / "manifest.json").read_text())
  manifest["prefill_seconds"] += 1.0  # its checksum no longer matches
  (saved / "manifest.json").write_text(json.dumps(manifest))
  with caplog.at_level("WARNING"):
    (record,) = kveval.run_sample(model, sample, specs, max_new_tokens=4, contexts=store)
  assert not record["context_loaded"] and "does not load" in caplog.text
  (record,) = kveval.run_sample(model, sample, specs, max_new_tokens=4, contexts=store)
  assert record["context_loaded"]


def test_bad_arguments_are_refused(tmp_path):
  with pytest.raises(TypeError, match="made_by"):
    kveval.ContextStore(tmp_path, made_by=3)
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="not a directory"):
    kveval.ContextStore(tmp_path / "file")
