"""Orbax cache of converted parameters, so a second start skips parsing and dequantization.

Layout: `<root>/params/<key>/{meta.json, tokenizer.json?, ckpt/}` where root is `cache_dir`,
else $KVJAX_CACHE, else ~/.cache/kvjax, and

    key = sha256({name, source, dtype, format})[:24]
    source = "sha256:<hex>" (a checksum-verified file) or "file:<path>:<mtime_ns>:<size>"
             (a file, or every file of a directory)

so a changed source file or a different dtype never hits an old entry. `meta.json` records the
config (and its `config_hash`); `load` rebuilds the config, checks the hash and restores the
arrays against `param_shapes(cfg)` — any mismatch or unreadable entry is treated as a miss and
removed, and the caller's next `save` rewrites it. An entry is written into a temporary
sibling folder and renamed into place (orbax itself also writes `ckpt/` under a temporary
name and renames it when finished), so a crash never leaves a half entry under the key.
Bump `FORMAT` when a loader's conversion changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig, RopeScaling, leaf_dtype, param_shapes

FORMAT = 2  # 2: norm weights stored float32 (models.config.leaf_dtype)


def cache_root(cache_dir: str | os.PathLike | None = None) -> str:
  """`<cache_dir or $KVJAX_CACHE or ~/.cache/kvjax>/params`."""
  base = os.fspath(cache_dir) if cache_dir is not None else None
  base = base or os.environ.get("KVJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvjax")
  return os.path.join(base, "params")


def source_id(path: str | os.PathLike, *, sha256: str | None = None) -> str:
  """Identity of a weights source: its verified sha256, else path + mtime + size of its files."""
  if sha256:
    return f"sha256:{sha256.lower()}"
  path = os.path.abspath(os.fspath(path))
  if os.path.isdir(path):
    parts = []
    for f in sorted(os.listdir(path)):
      full = os.path.join(path, f)
      if os.path.isfile(full):
        st = os.stat(full)
        parts.append(f"{f}:{st.st_mtime_ns}:{st.st_size}")
    return f"dir:{path}:" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
  st = os.stat(path)
  return f"file:{path}:{st.st_mtime_ns}:{st.st_size}"


def cache_key(*, name: str, source: str, dtype: str) -> str:
  blob = json.dumps({"name": name, "source": source, "dtype": dtype, "format": FORMAT}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:24]


def config_to_dict(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> ModelConfig:
  d = dict(d)
  if d.get("rope_scaling") is not None:
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
  if d.get("layer_windows") is not None:
    d["layer_windows"] = tuple(d["layer_windows"])
  return ModelConfig(**d)


def _checkpointer():
  import orbax.checkpoint as ocp

  return ocp.StandardCheckpointer()


def _saved_shapes(checkpointer, path: str):
  """The shape tree of a saved checkpoint from its metadata, or None where this orbax version
  lays its metadata out otherwise (the restore then checks the shapes)."""
  try:
    meta = checkpointer.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return jax.tree.map(lambda x: tuple(x.shape), tree, is_leaf=lambda x: hasattr(x, "shape"))
  except Exception:  # pylint: disable=broad-except
    return None


def save(key: str, cfg: ModelConfig, params, *, extra: dict | None = None, cache_dir=None) -> str:
  """Writes `params` (NumPy or jax arrays, layer-stacked) and `cfg` under `key`, atomically.

  Args:
    key: from `cache_key`.
    cfg: the config the params belong to.
    params: the parameter pytree, already in `cfg.dtype`.
    extra: JSON-able extras; a "tokenizer" entry (a string) is stored in its own file.
    cache_dir: see `cache_root`.

  Returns:
    The entry's folder. Failures to write are not fatal: they are reported and ignored
    (the cache is an optimization).
  """
  root = cache_root(cache_dir)
  final = os.path.join(root, key)
  tmp = os.path.join(root, f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  try:
    os.makedirs(tmp)
    extra = dict(extra or {})
    tok = extra.pop("tokenizer", None)
    ck = _checkpointer()
    ck.save(os.path.join(tmp, "ckpt"), params)
    ck.wait_until_finished()
    ck.close()
    if tok is not None:
      with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        f.write(tok)
    meta = {
        "format": FORMAT,
        "key": key,
        "config": config_to_dict(cfg),
        "config_hash": cfg.config_hash(),
        "has_tokenizer": tok is not None,
        "extra": extra,
    }
    with open(os.path.join(tmp, "meta.json"), "w") as f:
      json.dump(meta, f)
    if os.path.exists(final):
      shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _prune(root, keep=key, name=cfg.name, dtype=cfg.dtype, source=extra.get("source"))
    return final
  except Exception as e:  # the cache is an optimization: never fail a load because of it
    shutil.rmtree(tmp, ignore_errors=True)
    import warnings

    warnings.warn(f"could not write the parameter cache entry {final}: {type(e).__name__}: {e}", stacklevel=2)
    return final


def _prune(root: str, *, keep: str, name: str, dtype: str, source: str | None) -> None:
  """Removes other entries of the same model name, dtype and source path (stale versions)."""
  if source is None:
    return
  for entry in os.listdir(root):
    if entry == keep or entry.startswith("."):
      continue
    meta = _read_meta(os.path.join(root, entry))
    if meta is None:
      continue
    c = meta.get("config", {})
    if c.get("name") == name and c.get("dtype") == dtype and meta.get("extra", {}).get("source") == source:
      shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _read_meta(entry: str) -> dict | None:
  try:
    with open(os.path.join(entry, "meta.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def load(key: str, *, cache_dir=None, device=None) -> tuple[ModelConfig, Any, dict] | None:
  """Restores an entry as (cfg, params on `device`, extra), or None on a miss.

  A present but unusable entry (unreadable, wrong format, config hash or shapes that do not
  match) is removed and reported as a miss.
  """
  entry = os.path.join(cache_root(cache_dir), key)
  if not os.path.isdir(entry):
    return None
  meta = _read_meta(entry)
  try:
    if meta is None or meta.get("format") != FORMAT or meta.get("key") != key:
      raise ValueError("missing or stale meta.json")
    cfg = config_from_dict(meta["config"])
    if cfg.config_hash() != meta["config_hash"]:
      raise ValueError(f"config hash {cfg.config_hash()} != stored {meta['config_hash']}")
    device = device or jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree_util.tree_map_with_path(
        lambda path, s: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(leaf_dtype(path[-1].key, cfg.dtype)), sharding=sharding),
        param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    ck = _checkpointer()
    saved = _saved_shapes(ck, os.path.join(entry, "ckpt"))
    if saved is not None and saved != jax.tree.map(lambda a: a.shape, abstract):
      # Checked before the restore: one that fails part-way leaves orbax's coroutines abandoned.
      raise ValueError("stored shapes differ from the config's")
    params = ck.restore(os.path.join(entry, "ckpt"), abstract)
    ck.close()
    got = jax.tree.map(lambda a: (tuple(a.shape), a.dtype), params)
    want = jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    if got != want:
      raise ValueError("restored shapes/dtypes differ from the config's")
    extra = dict(meta.get("extra", {}))
    if meta.get("has_tokenizer"):
      with open(os.path.join(entry, "tokenizer.json")) as f:
        extra["tokenizer"] = f.read()
    return cfg, params, extra
  except Exception as e:
    import warnings

    warnings.warn(f"ignoring unusable parameter cache entry {entry}: {type(e).__name__}: {e}", stacklevel=2)
    shutil.rmtree(entry, ignore_errors=True)
    return None


__all__ = ["cache_root", "source_id", "cache_key", "save", "load", "config_from_dict", "config_to_dict", "FORMAT"]
