"""Tokenizers from GGUF metadata or a `tokenizer.json`, on the `tokenizers` library (no torch).

* Byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Qwen2, Llama 3) is built here
  from the GGUF's tokens and merges, with the pre-tokenizer llama.cpp uses for
  `tokenizer.ggml.pre` (e.g. "smollm": single digits, then GPT-2's split).
* SentencePiece-style BPE (`"llama"`: Gemma 3, Llama 2) is built by transformers' own GGUF
  tokenizer builders (`transformers.integrations.gguf`), which need no torch.

BOS is added by `Tokenizer.encode` itself (never by a post-processor), so
`encode(text, add_bos=False)` always gives the bare pieces. Chat templates are rendered with
jinja2's sandbox like transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
import os
import warnings
from datetime import datetime
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# Stop tokens recognized by name when the vocabulary has them as special tokens.
_STOP_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` values -> pre-tokenizer kind (llama-vocab.cpp regex_exprs).
_PRE_KIND = {
    **dict.fromkeys(("gpt-2", "gpt2", "default", "mpt", "olmo", "jais", "trillion"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), "digits"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), "qwen2"),
}

_CONTROL, _USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _byte_level_pre_tokenizer(pre: str | None):
  kind = _PRE_KIND.get(pre or "default")
  if kind is None:
    warnings.warn(f"unknown tokenizer.ggml.pre={pre!r}; using GPT-2's pre-tokenizer", stacklevel=3)
    kind = "gpt2"
  if kind == "gpt2":
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if kind == "digits":
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
  split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[kind]
  return pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
  )


def _build_byte_level(tokens: list[str], merges: list[str], token_types: Sequence[int], pre: str | None):
  """A `tokenizers.Tokenizer` for a GGUF byte-level BPE vocabulary."""
  vocab: dict[str, int] = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t, i)
  pairs = []
  for m in merges:
    parts = m.split(" ")
    if len(parts) != 2:
      raise ValueError(f"malformed BPE merge {m!r}")
    pairs.append((parts[0], parts[1]))
  kind = _PRE_KIND.get(pre or "default")
  tok = tokenizers.Tokenizer(
      models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=kind == "llama3")
  )
  if kind == "qwen2":
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  special, user = [], []
  for t, ty in zip(tokens, token_types):
    if ty == _CONTROL:  # already in `vocab`, so adding keeps its id and the vocabulary size
      special.append(AddedToken(t, special=True, normalized=False))
    elif ty == _USER_DEFINED:
      user.append(AddedToken(t, special=False, normalized=False))
  if special:
    tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)
  return tok


def _build_sentencepiece(arch: str, tokens, scores, token_types, merges, extra: dict):
  """Gemma / Llama-2 style tokenizers through transformers' GGUF builders (torch-free)."""
  try:  # recent transformers (5.24 here)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
  except ImportError:  # earlier ones (5.17, the GPU machine's: the same ids on Gemma-3-270M)
    from transformers.integrations.ggml import convert_gguf_tokenizer

  d = {"tokenizer_type": "llama", "tokens": tokens, "token_type": token_types}
  if scores is not None:
    d["scores"] = scores
  if merges:
    d["merges"] = merges
  d.update(extra)
  backend, _ = convert_gguf_tokenizer(arch, d)
  backend.post_processor = None  # BOS is added by Tokenizer.encode
  return backend


def _field(reader, key, default=None):
  """A metadata value from a `models.gguf_weights.GGUFFile` (or a `gguf.GGUFReader`)."""
  if hasattr(reader, "metadata"):
    v = reader.metadata.get(key, default)
  else:
    f = reader.fields.get(key)
    v = default if f is None else f.contents()
  return v.tolist() if hasattr(v, "tolist") else v


class Tokenizer:
  """A text <-> token id codec with the model's special tokens and chat template.

  Attributes:
    bos_id, eos_id, pad_id: special ids (None when the model has none).
    eos_ids: every id that ends generation (eos plus end-of-turn tokens).
    chat_template: the Jinja chat template, or None.
    add_bos: whether `encode` prepends BOS by default (the model's own setting).
  """

  def __init__(
      self,
      tok: tokenizers.Tokenizer,
      *,
      bos_id: int | None,
      eos_id: int | None,
      pad_id: int | None = None,
      extra_eos_ids: Iterable[int] = (),
      chat_template: str | None = None,
      add_bos: bool = False,
  ):
    self._tok = tok
    self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
    self.chat_template = chat_template
    self.add_bos = bool(add_bos)
    ids = set(int(i) for i in extra_eos_ids)
    if eos_id is not None:
      ids.add(int(eos_id))
    for name in _STOP_TOKENS:
      i = tok.token_to_id(name)
      if i is not None and self._is_special(name):
        ids.add(i)
    self.eos_ids: frozenset[int] = frozenset(ids)

  def _is_special(self, token: str) -> bool:
    return any(t.content == token and t.special for t in self._tok.get_added_tokens_decoder().values())

  # ---------------------------------------------------------------- construction
  @classmethod
  def from_gguf(cls, path_or_reader) -> "Tokenizer":
    """Builds the tokenizer stored in a GGUF file's metadata (a path or an opened GGUFFile)."""
    if isinstance(path_or_reader, (str, os.PathLike)):
      from models.gguf_weights import open_gguf

      reader = open_gguf(path_or_reader)
    else:
      reader = path_or_reader
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
      raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = _field(reader, "tokenizer.ggml.merges") or []
    pre = _field(reader, "tokenizer.ggml.pre")
    arch = _field(reader, "general.architecture")
    if model == "gpt2":
      tok = _build_byte_level(tokens, merges, types, pre)
      add_bos_default = False
    elif model == "llama":
      extra = {}
      add_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
      if add_prefix is not None:
        extra["add_prefix_space"] = bool(add_prefix)
      tok = _build_sentencepiece(arch, tokens, _field(reader, "tokenizer.ggml.scores"), types, merges, extra)
      add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
    else:
      raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: gpt2, llama")
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    extra_eos = [
        i for i in (_field(reader, "tokenizer.ggml.eot_token_id"), _field(reader, "tokenizer.ggml.eom_token_id")) if i is not None
    ]
    return cls(
        tok,
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        extra_eos_ids=extra_eos,
        chat_template=_field(reader, "tokenizer.chat_template"),
        add_bos=add_bos_default if add_bos is None else bool(add_bos),
    )

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
    """Loads a HF `tokenizer.json` (or a directory holding one and `tokenizer_config.json`)."""
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    tok_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(tok_file):
      raise ValueError(f"no tokenizer.json at {tok_file!r}")
    tok = tokenizers.Tokenizer.from_file(tok_file)
    conf = _read_json(os.path.join(directory, "tokenizer_config.json"))
    gen = _read_json(os.path.join(directory, "generation_config.json"))

    def token_id(key):
      v = conf.get(key)
      if isinstance(v, dict):
        v = v.get("content")
      return tok.token_to_id(v) if isinstance(v, str) else None

    template = conf.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t.get("name"): t.get("template") for t in template}
      template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
      with open(jinja_file) as f:
        template = f.read()
    extra = gen.get("eos_token_id", [])
    extra = [extra] if isinstance(extra, int) else list(extra or [])
    # A post-processor that adds BOS (Llama's TemplateProcessing) is honoured through add_bos.
    add_bos = conf.get("add_bos_token")
    if add_bos is None:
      add_bos = token_id("bos_token") is not None and tok.encode("a").ids[:1] == [token_id("bos_token")]
    tok.post_processor = None
    return cls(
        tok,
        bos_id=token_id("bos_token"),
        eos_id=token_id("eos_token"),
        pad_id=token_id("pad_token"),
        extra_eos_ids=extra,
        chat_template=template,
        add_bos=bool(add_bos),
    )

  # ---------------------------------------------------------------- serialization
  def to_json(self) -> str:
    """Everything needed to rebuild this tokenizer (used by the parameter cache)."""
    return json.dumps(
        {
            "tokenizer": self._tok.to_str(),
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "eos_ids": sorted(self.eos_ids),
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
        }
    )

  @classmethod
  def from_json(cls, blob: str) -> "Tokenizer":
    d = json.loads(blob)
    return cls(
        tokenizers.Tokenizer.from_str(d["tokenizer"]),
        bos_id=d["bos_id"],
        eos_id=d["eos_id"],
        pad_id=d["pad_id"],
        extra_eos_ids=d["eos_ids"],
        chat_template=d["chat_template"],
        add_bos=d["add_bos"],
    )

  # ---------------------------------------------------------------- codec
  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    return self._tok

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") map to their ids.

    Args:
      text: the string to encode.
      add_bos: prepend BOS; None uses the model's own setting (`self.add_bos`). A text that
        already starts with the BOS token gets no second one.
    """
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos is None:
      add_bos = self.add_bos
    if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  # ---------------------------------------------------------------- chat
  @property
  def has_chat_template(self) -> bool:
    return bool(self.chat_template)

  def apply_chat_template(
      self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs
  ) -> str:
    """Renders `messages` ([{"role": ..., "content": ...}]) with the model's Jinja template.

    Runs in jinja2's immutable sandbox with transformers' helpers (`raise_exception`,
    `strftime_now`, a `tojson` filter, loop controls, the `{% generation %}` tag), and passes
    `bos_token`, `eos_token`, `pad_token` and any extra keyword arguments.

    Returns:
      The prompt text (encode it with `add_bos=False` when the template writes BOS itself).
    """
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    template = _compile(self.chat_template)
    tok = lambda i: self._tok.id_to_token(i) if i is not None else None  # noqa: E731
    return template.render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=tok(self.bos_id) or "",
        eos_token=tok(self.eos_id) or "",
        pad_token=tok(self.pad_id) or "",
        **kwargs,
    )


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


_TEMPLATES: dict[str, Any] = {}


def _compile(source: str):
  if source in _TEMPLATES:
    return _TEMPLATES[source]
  import jinja2
  import jinja2.ext
  import jinja2.nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  compiled = env.from_string(source)
  _TEMPLATES[source] = compiled
  return compiled


__all__ = ["Tokenizer"]
