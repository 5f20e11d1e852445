"""RULER's aggregation tasks: common and frequent words extraction (Hsieh et al. 2024, §3.1).

Common words extraction (CWE): a numbered list "1. word 2. word ..." in which `num_cw` = 10
common words appear `freq_cw` = 30 times each and every other word `freq_ucw` = 3 times
(RULER's settings from 4K tokens on; below 4K it uses 6 and 1); the question asks for the 10
most common words. One worked example (40 words, 10 / 3 repeats; 20 words, 3 / 1 below 4K)
precedes the prompt, as in RULER. Words come from kvjax.eval.words (535, enough for ~13K tokens
of Qwen2.5's); past them the uncommon words are adjective + noun compounds ("quietriver"), where
RULER draws every word from wonderwords' English lists, which kvjax does not ship. The common
words are always real words, and words that occur inside no other word of the lists or the
compounds (130 of the 535, mostly verbs): string_match_all counts an answer found anywhere in
the text, so a common word inside an uncommon one ("table" in "stable", "quiet" in "quietriver")
would score when the model names the uncommon word (until 2026-12-05 the common words were any of
the 535). The prompt grows with the number of distinct uncommon words.

Frequent words extraction (FWE): "coded" words of `coded_wordlen` = 6 random lower-case
letters, a vocabulary of length // 50 of them, word k (1-based rank) appearing
floor(n · k^-alpha / zeta(alpha)) times with alpha = 2 (a Zipf law), the whole text shuffled;
the top-ranked word is replaced by "..." as noise, and the answer is ranks 2-4. The prompt
grows with n.

Both are scored by string_match_all.
"""

from __future__ import annotations

import functools
import random
import string

from kvjax.eval import sizing, words
from kvjax.eval.sample import Sample

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


def _numbered(items: list[str]) -> str:
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


def _word_list(vocab: list[str], num_words: int, num_cw: int, freq_cw: int, freq_ucw: int, rng: random.Random):
  common, uncommon = vocab[:num_cw], vocab[num_cw:num_words]
  items = common * freq_cw + uncommon * freq_ucw
  rng.shuffle(items)
  return items, common


def _compound_words(rng: random.Random) -> list[str]:
  """Adjective + noun compounds ("quietriver"), shuffled: uncommon words past the word list."""
  known = set(words.ALL_WORDS)
  out = [w for w in dict.fromkeys(a + n for a in words.ADJECTIVES for n in words.NOUNS) if w not in known]
  rng.shuffle(out)
  return out


@functools.cache
def standalone_words() -> frozenset[str]:
  """The words of kvjax.eval.words that occur inside no other word of the lists or of the
  adjective + noun compounds: the common words of CWE (see the module docstring)."""
  text = "\n" + "\n".join(list(words.ALL_WORDS) + _compound_words(random.Random(0))) + "\n"
  return frozenset(w for w in words.ALL_WORDS if text.count(w) == text.count(f"\n{w}\n"))


def common_words(tokenizer: sizing.TextTokenizer, *, length: int, seed: int = 0, num_cw: int = 10,
                 freq_cw: int | None = None, freq_ucw: int | None = None,
                 tolerance: float = sizing.DEFAULT_TOLERANCE) -> Sample:
  """One CWE sample of `length` tokens (see the module docstring)."""
  short = length < 4096  # RULER's switch to smaller repeat counts
  freq_cw = freq_cw if freq_cw is not None else (6 if short else 30)
  freq_ucw = freq_ucw if freq_ucw is not None else (1 if short else 3)
  if not freq_cw > freq_ucw >= 1:
    raise ValueError(f"need {freq_cw=} > {freq_ucw=} >= 1")
  rng = random.Random(f"cwe/{seed}")
  vocab = list(words.ALL_WORDS)
  ex_vocab = rng.sample(vocab, 20 if short else 40)
  ex_items, ex_common = _word_list(ex_vocab, len(ex_vocab), num_cw, 3 if short else 10, 1 if short else 3, rng)
  example = CWE_TEMPLATE.format(context=_numbered(ex_items)) + "\n" + CWE_PREFIX + " " + _numbered(ex_common) + "\n\n"
  rng.shuffle(vocab)  # prefix-stable: n words are always vocab[:n], the first num_cw the common ones
  standalone = standalone_words()
  common = [w for w in vocab if w in standalone][:num_cw]
  vocab = common + [w for w in vocab if w not in common]
  shuffle_seed = rng.getrandbits(64)
  vocab += _compound_words(random.Random(f"cwe/{seed}/compounds"))
  head, tail = CWE_TEMPLATE.split("{context}")

  def build(n: int):
    items, common = _word_list(vocab, n, num_cw, freq_cw, freq_ucw, random.Random(shuffle_seed))
    context = _numbered(items)
    return example + head + context + tail, len(example) + len(head), context, common

  (text, start, context, common), n, tokens = sizing.fit_units(
      build, lambda b: b[0], tokenizer, target=length, min_units=num_cw + 1, tolerance=tolerance,
      # Every listed word costs at least two tokens ("12." and the word), freq_ucw times: a bound on n.
      max_units=min(len(vocab), num_cw + length // (2 * freq_ucw) + 1))
  return Sample(task="cwe", text=text, answers=tuple(common), metric="all", answer_prefix=CWE_PREFIX, length=length,
                tokens=tokens, depth=None, needle_depths=(), context_span=(start, start + len(context)),
                needle_spans=(), max_new_tokens=120, seed=seed,
                meta={"num_words": n, "freq_cw": freq_cw, "freq_ucw": freq_ucw})


def _zeta(alpha: float, terms: int = 10_000) -> float:
  """Riemann zeta(alpha) for alpha > 1: a partial sum plus the integral of the tail."""
  return sum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


def frequent_words(tokenizer: sizing.TextTokenizer, *, length: int, seed: int = 0, alpha: float = 2.0,
                   coded_wordlen: int = 6, vocab_size: int | None = None,
                   tolerance: float = sizing.DEFAULT_TOLERANCE) -> Sample:
  """One FWE sample of `length` tokens (see the module docstring)."""
  if alpha <= 1.0:
    raise ValueError(f"{alpha=} must be > 1 (a Zipf law with a finite zeta)")
  vocab_size = vocab_size or max(8, length // 50)
  rng = random.Random(f"fwe/{seed}")
  vocab: list[str] = []
  while len(vocab) < vocab_size:
    w = "".join(rng.choices(string.ascii_lowercase, k=coded_wordlen))
    if w not in vocab:
      vocab.append(w)
  vocab[0] = "..."  # RULER: the top-ranked word is noise, to be ignored
  zeta = _zeta(alpha)
  shuffle_seed = rng.getrandbits(64)
  head, tail = FWE_TEMPLATE.split("{context}")

  def build(n: int):
    counts = [int(n * (k**-alpha) / zeta) for k in range(1, vocab_size + 1)]
    items = [w for w, c in zip(vocab, counts) for _ in range(c)]
    random.Random(shuffle_seed).shuffle(items)
    context = " ".join(items)
    return head + context + tail, len(head), context, counts

  (text, start, context, counts), n, tokens = sizing.fit_units(
      build, lambda b: b[0], tokenizer, target=length, max_units=8 * length, min_units=64, tolerance=tolerance)
  if not counts[1] > counts[2] > counts[3] > counts[4]:
    raise ValueError(f"FWE counts {counts[:5]} do not separate the top three words at {length=}")
  return Sample(task="fwe", text=text, answers=tuple(vocab[1:4]), metric="all", answer_prefix=FWE_PREFIX,
                length=length, tokens=tokens, depth=None, needle_depths=(), context_span=(start, start + len(context)),
                needle_spans=(), max_new_tokens=50, seed=seed,
                meta={"num_words": n, "vocab_size": vocab_size, "top_counts": counts[:5], "alpha": alpha})
