"""kvjax.eval: task generators, scorers and the runner (CPU, seconds)."""

import collections
import json
import re

import pytest
from byte_tokenizer import byte_tokenizer

from kvjax import eval as kveval
from kvjax.eval import layout, sizing, words
from models.registry import smollm2_gguf_path
from models.tokenizer import Tokenizer

LENGTH = 1024  # small prompts keep the suite fast; sizing does not depend on the length


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_gguf(smollm2_gguf_path())


def _offsets(tok, text):
  """Character offset where each token of `text` starts (the tokenizer's own offsets)."""
  return [start for start, _ in tok.backend.encode(text, add_special_tokens=False).offsets]


def _token_index(starts, char):
  """Index of the token that holds character `char`."""
  return max(i for i, s in enumerate(starts) if s <= char)


@pytest.mark.parametrize("task", kveval.task_names())
def test_generators_are_deterministic_and_sized(tok, task):
  depth = 0.5 if task == "needle" else None
  a = kveval.make_sample(task, tok, length=LENGTH, seed=3, depth=depth)
  b = kveval.make_sample(task, tok, length=LENGTH, seed=3, depth=depth)
  c = kveval.make_sample(task, tok, length=LENGTH, seed=4, depth=depth)
  assert a == b
  assert a.text != c.text and a.task == task
  # Within the tolerance, or within one unit where units are coarser (a kv pair is ~70 tokens).
  assert LENGTH - max(sizing.DEFAULT_TOLERANCE * LENGTH, 80) <= a.tokens <= LENGTH
  assert a.tokens == len(tok.encode(a.text, add_bos=False))
  for answer in a.answers:
    assert answer in a.context, (task, answer)


@pytest.mark.parametrize("task", ["needle", "niah_single_1", "niah_single_3", "niah_multikey_1", "passkey",
                                  "kv_retrieval"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_requested_token_depth(tok, task, depth):
  """Depth = haystack tokens before the asked needle / all haystack tokens (needles left out),
  counted on the tokenizer's own offsets of the whole prompt."""
  sample = kveval.make_sample(task, tok, length=LENGTH, seed=1, depth=depth)
  starts = _offsets(tok, sample.text)
  begin, end = sample.context_span

  def in_needle(char):
    return any(s <= char < e for s, e in sample.needle_spans)

  haystack = [i for i, c in enumerate(starts) if begin <= c < end and not in_needle(c)]
  marker = json.dumps(sample.meta["key"]) if task == "kv_retrieval" else sample.answers[0]
  asked = next(s for s, e in sample.needle_spans if s <= sample.text.index(marker, begin) < e)
  measured = sum(i < _token_index(starts, asked) for i in haystack) / len(haystack)
  # Needles go between haystack units: the placement is exact up to one unit.
  tolerance = max(0.02, 1.0 / sample.meta["units"])
  assert measured == pytest.approx(depth, abs=tolerance), (measured, sample.meta)
  assert sample.meta["answer_depths"][0] == pytest.approx(measured, abs=0.01)


def test_early_stop_only_once_the_score_is_final(tok):
  """Sample.complete: every answer present under a substring metric (the score cannot change
  with more text), whatever precedes or follows; never under kv_exact."""
  for task in ("niah_single_3", "niah_multivalue", "vt", "cwe"):
    sample = kveval.make_sample(task, tok, length=LENGTH, seed=0)
    answers = list(sample.answers)
    assert not sample.complete("")
    assert not sample.complete(":\n\n" + " ".join(answers[:-1]))  # one answer missing
    assert sample.complete(":\n\n* " + "\n* ".join(answers) + "\n")
  kv = kveval.make_sample("kv_retrieval", tok, length=LENGTH, seed=0)
  assert kv.score(kv.answers[0]) == 1.0 and not kv.complete(kv.answers[0])


def test_multi_needle_depths_are_rulers(tok):
  sample = kveval.make_sample("niah_multivalue", tok, length=LENGTH, seed=0)
  assert len(sample.needle_depths) == 4 and list(sample.needle_depths) == sorted(sample.needle_depths)
  with pytest.raises(ValueError, match="depth"):
    kveval.make_sample("niah_multivalue", tok, length=LENGTH, depth=0.5)
  with pytest.raises(ValueError, match="depth"):
    kveval.make_sample("cwe", tok, length=LENGTH, depth=0.5)


class _MergingTokenizer:
  """Words are tokens, and so is a newline, except right after a period (".\n" is one token,
  as in Qwen2.5's vocabulary): a unit counted alone with its separator costs one token more
  than it does inside the joined text."""

  def encode(self, text, *, add_bos=None):
    return re.findall(r"(?<!\.)\n|[^\s]+", text)


def test_layout_fills_the_target_where_the_tokenizer_merges_across_units():
  units = (f"One of the special magic numbers for key-{i} is: {1_000_000 + i}." for i in range(10**6))
  built = layout.fit_layout(_MergingTokenizer(), units, ["The needle is: 7."], [0.5],
                            lambda context: (context, 0), length=2000, sep="\n")
  assert 2000 * (1 - sizing.DEFAULT_TOLERANCE) <= built.tokens <= 2000
  assert built.tokens == len(_MergingTokenizer().encode(built.text))


def test_too_short_a_target_is_refused(tok):
  with pytest.raises(ValueError, match="tokens"):
    kveval.make_sample("niah_single_2", tok, length=40)


def test_scorers_on_hand_made_answers():
  refs = ["1234567", "7654321"]
  assert kveval.string_match_all("The numbers are 1234567 and 7654321.", refs) == 1.0
  assert kveval.string_match_all("The numbers are 1234567 and 7777777.", refs) == 0.5
  assert kveval.string_match_all("I do not know.", refs) == 0.0
  assert kveval.string_match_part("only 7654321", refs) == 1.0
  assert kveval.string_match_part("neither", refs) == 0.0
  assert kveval.string_match_all("  JPTWO, xnpwo\x07", ["jptwo", "XNPWO"]) == 1.0  # case and control chars
  value = "87ef3e22-7a16-4306-92d1-3c1843533caa"
  assert kveval.kv_exact(f' "{value}".', [value]) == 1.0
  assert kveval.kv_exact(f"{value}ff", [value]) == 0.0  # a longer token is not the value
  assert kveval.kv_exact(value[:20], [value]) == 0.0
  assert kveval.score("x 1234567", ["1234567"], "all") == 1.0
  with pytest.raises(ValueError, match="metric"):
    kveval.score("x", ["x"], "bleu")


def test_sample_score_uses_its_metric(tok):
  sample = kveval.make_sample("kv_retrieval", tok, length=LENGTH, seed=2)
  assert sample.metric == "kv_exact"
  assert sample.score(f" {sample.answers[0]}.") == 1.0
  assert sample.score(f" {sample.answers[0][:-1]}") == 0.0


def test_kv_retrieval_json_parses_and_the_key_is_there_once(tok):
  for seed in range(3):
    sample = kveval.make_sample("kv_retrieval", tok, length=LENGTH, seed=seed)
    obj = json.loads("{" + sample.context + "}")
    key = sample.meta["key"]
    assert obj[key] == sample.answers[0]
    assert sample.context.count(key) == 1
    assert len(obj) == sample.meta["pairs"] == sample.context.count(": ")
    assert f'Key: "{key}"' in sample.text[sample.context_span[1]:]


def _resolve(context):
  """Every variable's value, following the chain statements of a vt context."""
  value = {}
  for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", context):
    value[name] = value[rhs[4:]] if rhs.startswith("VAR") else rhs
  return value


@pytest.mark.parametrize(("num_chains", "num_hops"), [(1, 4), (2, 3)])
def test_variable_tracking_chains_resolve_to_the_answer(tok, num_chains, num_hops):
  sample = kveval.make_sample("vt", tok, length=LENGTH, seed=5, num_chains=num_chains, num_hops=num_hops)
  values = _resolve(sample.context)
  holders = {name for name, v in values.items() if v == sample.meta["value"]}
  assert holders == set(sample.answers)
  assert len(sample.answers) == num_hops + 1
  assert len(values) == num_chains * (num_hops + 1)
  assert f"assigned the value {sample.meta['value']}" in sample.text


@pytest.mark.parametrize("length", [LENGTH, 4096])
def test_cwe_answers_are_the_most_common_words(tok, length):
  sample = kveval.make_sample("cwe", tok, length=length, seed=0)
  items = re.findall(r"\d+\. (\S+)", sample.context)
  counts = collections.Counter(items).most_common()
  assert {w for w, _ in counts[:10]} == set(sample.answers)
  assert counts[9][1] > counts[10][1]
  assert counts[0][1] == sample.meta["freq_cw"] and counts[10][1] == sample.meta["freq_ucw"]


def test_cwe_runs_on_past_the_word_list_with_compounds(tok):
  """535 listed words fill ~13K tokens; longer prompts add adjective + noun compounds, all distinct."""
  sample = kveval.make_sample("cwe", tok, length=20_000, seed=1)
  assert 20_000 * (1 - sizing.DEFAULT_TOLERANCE) <= sample.tokens <= 20_000
  items = re.findall(r"\d+\. (\S+)", sample.context)
  distinct = set(items)
  assert len(distinct) == sample.meta["num_words"] > len(words.ALL_WORDS)
  assert set(sample.answers) <= set(words.ALL_WORDS)  # the common words stay real words
  counts = collections.Counter(items).most_common()
  assert {w for w, _ in counts[:10]} == set(sample.answers) and counts[10][1] == sample.meta["freq_ucw"]
  # Naming any other listed word scores no answer: no common word occurs inside another word.
  others = distinct - set(sample.answers)
  assert not any(answer in other for answer in sample.answers for other in others)
  assert sample.score(" ".join(sorted(others))) == 0.0


def test_fwe_answers_are_the_most_frequent_coded_words(tok):
  sample = kveval.make_sample("fwe", tok, length=LENGTH, seed=0)
  counts = collections.Counter(sample.context.split()).most_common()
  assert counts[0][0] == "..."  # RULER's noise word ranks first and is not an answer
  assert [w for w, _ in counts[1:4]] == list(sample.answers)
  assert counts[3][1] > counts[4][1]


def test_runner_records_on_random_tiny():
  """Random weights: only the records' structure is checked, never accuracy."""
  import dataclasses

  import kvjax

  model = kvjax.load_model("random:tiny")
  model = dataclasses.replace(model, tokenizer=byte_tokenizer())
  sample = kveval.make_sample("niah_single_1", model.tokenizer, length=700, seed=0, depth=0.5)
  retrieval = {"index": "flat", "topk": 16, "sinks": 16, "window": 64}
  specs = [kveval.PolicySpec("full"), kveval.PolicySpec("retrieval", retrieval, label="retrieval"),
           kveval.PolicySpec("retrieval", retrieval | {"speculative": True}, label="speculative")]
  records = kveval.run_sample(model, sample, specs, max_new_tokens=4)
  assert [r["policy"] for r in records] == ["full", "retrieval", "speculative"]
  for r in records:
    assert r["task"] == "niah_single_1" and r["length"] == 700 and r["depth"] == 0.5
    assert r["prompt_tokens"] == len(kveval.prompt_ids(model.tokenizer, sample)) > 700
    assert 0.0 <= r["score"] <= 1.0 and isinstance(r["generated"], str)
    assert r["generated_tokens"] == 4 and r["ms_per_token"] > 0
    json.dumps(r)  # records go to results files as they are
  assert [r["prefill_shared"] for r in records] == [False, True, True]
  # The second member of the retrieval group decoded from a copy; the first decoded the prefilled context.
  assert records[1]["copy_seconds"] == 0 and records[2]["copy_seconds"] > 0 and records[0]["copy_seconds"] == 0
  parts = [records[2][f"copy_{part}"] for part in ("host_s", "device_s", "attach_s")]  # its parts, timed inside
  assert min(parts) > 0 and sum(parts) <= records[2]["copy_seconds"]
  assert not any(key.startswith("copy_") and key != "copy_seconds" for key in records[1])
  assert all(r["decode_seconds"] >= r["ms_per_token"] * 1e-3 for r in records)
  assert records[2]["options"]["speculative"] and "correction_rate" in records[2]["policy_stats"]
  assert "full_margin_at_split" not in records[0]  # full's logits give the others theirs
  for r in records[1:]:  # None exactly where the policy decoded full's very tokens
    same = r["generated"] == records[0]["generated"]
    assert (r["full_gap_at_split"] is None) == same
  # A member decoded from a copy of the shared prefill decodes as from its own prefill.
  alone = kveval.run_sample(model, sample, specs[2:], max_new_tokens=4)[0]
  assert not alone["prefill_shared"] and alone["generated"] == records[2]["generated"]


def test_runner_scores_the_split_with_fulls_own_logits():
  """The split fields equal split_at_reference over separate greedy decodes of full and the policy."""
  import dataclasses

  import kvjax
  from kvjax.eval.runner import split_at_reference

  model = dataclasses.replace(kvjax.load_model("random:tiny"), tokenizer=byte_tokenizer())
  sample = kveval.make_sample("niah_single_1", model.tokenizer, length=300, seed=1, depth=0.5)
  narrow = {"sinks": 4, "window": 4}  # random weights: so narrow a window departs from full within 6 tokens
  full, streaming = kveval.run_sample(
      model, sample, [kveval.PolicySpec("full"), kveval.PolicySpec("streaming", narrow, label="narrow")],
      max_new_tokens=6)
  ids = kveval.prompt_ids(model.tokenizer, sample)
  decoded = {policy: kvjax.decode(model, kvjax.prefill(model, ids, max_new_tokens=6, policy=policy,
                                                       policy_options=options),
                                  max_new_tokens=6, temperature=0.0, return_logits=policy == "full")
             for policy, options in (("full", {}), ("streaming", narrow))}
  want = split_at_reference(decoded["full"].tokens[0], decoded["streaming"].tokens[0],
                            decoded["full"].logits[:, 0], [])
  assert want["full_gap_at_split"] is not None  # it departs: the test reads real logits
  assert {k: streaming[k] for k in want} == want and "full_gap_at_split" not in full
  assert streaming["full_gap_at_split"] >= streaming["full_margin_at_split"] >= 0


def test_split_at_reference_reads_fulls_logits_where_the_tokens_first_depart():
  import numpy as np

  from kvjax.eval.runner import first_split, split_at_reference, top2_margins

  logits = np.array([[0.0, 3.0, 1.0, -2.0], [2.0, 2.5, -1.0, 0.0], [5.0, 0.0, 4.5, 1.0],
                     [0.0, 0.0, 0.0, 9.0]])  # [steps, vocab]; full chose 1, 1, 0, then stop token 3
  np.testing.assert_allclose(top2_margins(logits), [2.0, 0.5, 0.5, 9.0])
  ref, stop = [1, 1, 0], [3]
  assert first_split(ref, [1, 1, 0]) is None and first_split(ref, [1, 1]) == 2 and first_split(ref, [2]) == 0

  def split(tokens, stop_tokens=stop, rows=logits):
    got = split_at_reference(ref, tokens, rows, stop_tokens)
    return got["full_margin_at_split"], got["full_gap_at_split"], got["full_rank_at_split"]

  assert split([1, 1, 0]) == (None, None, None)  # the same tokens: no split
  assert split([2, 1, 0]) == (2.0, 2.0, 1)  # full's runner-up: the gap is the margin
  assert split([3, 1, 0]) == (2.0, 5.0, 3)  # its last choice: a small margin, a wide gap
  assert split([1, 1, 2, 7]) == (0.5, 0.5, 1)  # departs at the third token
  assert split([1, 1]) == (0.5, 4.0, 2)  # the policy chose the stop token where full went on
  assert split([1, 1], stop_tokens=[]) == (None, None, None)  # no stop token to score
  assert split([1, 1, 0, 2]) == (9.0, 9.0, 1)  # full chose the stop token there, the policy went on
  assert split([1, 1, 0, 2], rows=logits[:3]) == (None, None, None)  # full ended with no logits there


def test_policy_spec_parse_and_prefill_groups():
  spec = kveval.PolicySpec.parse("retrieval:index=roar:topk=100:speculative=true:tau=0.8@roar")
  assert spec == kveval.PolicySpec("retrieval", {"index": "roar", "topk": 100, "speculative": True, "tau": 0.8},
                                   label="roar")
  assert kveval.PolicySpec.parse("freekv").label == "freekv"
  assert kveval.PolicySpec.parse("streaming:dense_layers=0+1").options == {"dense_layers": (0, 1)}
  # Decode-time options (topk, speculative, tau) share a prefill; the index kind does not.
  assert spec.prefill_key() == kveval.PolicySpec.parse("retrieval:index=roar:topk=2000").prefill_key()
  assert spec.prefill_key() != kveval.PolicySpec.parse("retrieval:index=graph").prefill_key()
  with pytest.raises(ValueError, match="option=value"):
    kveval.PolicySpec.parse("retrieval:roar")
  with pytest.raises(ValueError, match="does not take"):
    kveval.PolicySpec.parse("full:topk=3")
