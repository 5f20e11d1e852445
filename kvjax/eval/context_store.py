"""Prefilled contexts kept on disk between evaluation runs, so a sample is prefilled and indexed once.

A study that reruns samples (an ablation of one lost seed, a new decode variant beside an old
one) spends most of its time in prefill and the index build: ~10 min each for Qwen2.5 at 32K on
a 2-core CPU, against a minute or two of decoding. `ContextStore` saves each context it prefills
with `kvjax.save_context` under a name derived from everything the context depends on, and a
later run that asks for the same one loads it (`kvjax.load_context`, which verifies every
array) instead of prefilling again.

The key holds the model's identity (name, architecture hash, dtype, weights fingerprint), the
device kind and count, XLA_FLAGS (deterministic GPU flags change the numbers), the prompt's
token ids, the policy with every option that shapes its state (defaults resolved, so a changed
default is a new key), the generation capacity and the prefill chunk. It does not hold the
code's version: a context made before a change to prefill or to an index build is reused as it
is. Each saved context records the `made_by` string it was saved with (eval CLIs pass the
commit), and each record of `run_sample` says whether its context was loaded and who made it;
use a new directory after such a change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import time

import jax
import numpy as np

import kvjax
from kvjax.policies import make_policy
from models.decoder import weights_fingerprint


@dataclasses.dataclass(frozen=True)
class StoredContext:
  """A context from the store: `loaded` when read from disk (else prefilled and saved now)."""

  context: "kvjax.PrefilledContext"
  loaded: bool
  load_seconds: float  # reading and verifying it; 0 when prefilled now
  made_by: str  # the `made_by` of the run that prefilled it


class ContextStore:
  """A directory of saved contexts, one subdirectory a key (see the module docstring)."""

  def __init__(self, directory: str | os.PathLike, *, made_by: str = ""):
    """directory: created if missing. made_by: saved with each new context (e.g. a commit)."""
    if not isinstance(made_by, str):
      raise TypeError(f"made_by must be a str, got {type(made_by).__name__}")
    self.directory = pathlib.Path(directory).expanduser().absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise ValueError(f"context store {str(self.directory)!r} exists and is not a directory")
    self.directory.mkdir(parents=True, exist_ok=True)
    self.made_by = made_by
    self._fingerprint: tuple = (None, "")  # (params, their weights_fingerprint)

  def key(self, model, ids: list[int], policy: str, options: dict, *, max_new_tokens: int,
          prefill_chunk: int) -> dict:
    """What the context of `ids` prefilled under `policy` depends on, as JSON-ready values."""
    resolved = make_policy(policy, **options)
    decode_only = set(resolved.decode_options)
    shaping = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)
               if f.name != "name" and f.name not in decode_only}
    mesh = getattr(model, "mesh", None)
    return {
        "model": {"name": model.cfg.name, "config_hash": model.cfg.config_hash(), "dtype": str(model.cfg.dtype),
                  "weights": self._weights(model)},
        "device_kind": jax.devices()[0].device_kind,
        "devices": 1 if mesh is None else int(mesh.size),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "prompt_tokens": len(ids),
        "prompt_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest(),
        "policy": policy,
        "options": {k: repr(v) for k, v in sorted(shaping.items())},
        "max_new_tokens": int(max_new_tokens),
        "prefill_chunk": int(prefill_chunk),
    }

  def path(self, key: dict) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return self.directory / f"{key['policy']}-{key['prompt_tokens']}-{digest}"

  def prefill(self, model, ids: list[int], policy: str, options: dict, *, max_new_tokens: int,
              prefill_chunk: int) -> StoredContext:
    """The context of `ids` under `policy` and `options`: loaded if stored, else prefilled and stored.

    A stored context that no longer loads (a format from older code, a damaged file) is
    reported with a warning and replaced by a new prefill.
    """
    key = self.key(model, ids, policy, options, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk)
    path = self.path(key)
    replace = False
    if path.exists():
      start = time.perf_counter()
      try:
        context = kvjax.load_context(path, model,
                                     policy_options=make_policy(policy, **options).decode_option_values())
      except ValueError as e:
        logging.warning("context store: %s does not load (%s); prefilling it again", path, e)
        replace = True
      else:
        if context.metadata.get("store_key") == key:
          return StoredContext(context, True, time.perf_counter() - start, str(context.metadata.get("made_by", "")))
        logging.warning("context store: %s holds another key; prefilling it again", path)
        replace = True
    context = kvjax.prefill(model, ids, max_new_tokens=max_new_tokens, policy=policy, policy_options=options,
                            prefill_chunk=prefill_chunk)
    context.metadata.update(store_key=key, made_by=self.made_by)
    try:
      kvjax.save_context(context, path, overwrite=replace)
    except ValueError:
      if replace or not path.exists():
        raise
      # Another process saved the same key between our check and our save: theirs stands.
    return StoredContext(context, False, 0.0, self.made_by)

  def _weights(self, model) -> str:
    """weights_fingerprint, once per params object (it reads a few rows off the device)."""
    if self._fingerprint[0] is not model.params:
      self._fingerprint = (model.params, weights_fingerprint(model.params))
    return self._fingerprint[1]
