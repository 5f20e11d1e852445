"""A 256-token byte-level tokenizer for text tasks on random:tiny (its vocabulary is 512)."""

import tokenizers

from models.tokenizer import Tokenizer, _bytes_to_unicode


def byte_tokenizer() -> Tokenizer:
  vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  return Tokenizer(tok, bos_id=None, eos_id=None)
