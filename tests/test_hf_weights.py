"""models/hf_weights.py: HF configs, state dicts and safetensors directories → kvjax.

The numerical check (converted params reproduce transformers' logits) is tests/test_parity.py;
here: the config fields, the safetensors reader (against a tiny writer below and, where
installed, the `safetensors` package), round trips, and the errors.
"""

import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from models.config import ModelConfig, RopeScaling, param_shapes
from models.hf_weights import config_from_hf, load_hf_directory, params_from_hf_state_dict, read_safetensors

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.npz"))
_CODES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
}


@functools.cache
def fixture(name):
  """(hf_config dict, {HF name: float32 array}) of one parity fixture."""
  data = np.load(FIXTURES / f"{name}.npz")
  state = {k: data[k] for k in data.files if k.startswith(("model.", "lm_head."))}
  return json.loads(str(data["hf_config"])), state


def write_safetensors(path, tensors, *, dtype=None):
  """A minimal safetensors writer: u64 header length, JSON header (8-byte padded), raw data."""
  header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
  for name, array in tensors.items():
    array = np.ascontiguousarray(array if dtype is None else np.asarray(array).astype(dtype))
    header[name] = {
        "dtype": _CODES[array.dtype],
        "shape": list(array.shape),
        "data_offsets": [offset, offset + array.nbytes],
    }
    blobs.append(array.tobytes())
    offset += array.nbytes
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  pathlib.Path(path).write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def write_checkpoint(directory, hf_config, state, *, shards=1, dtype=None):
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(hf_config))
  names = sorted(state)
  if shards == 1:
    write_safetensors(directory / "model.safetensors", state, dtype=dtype)
    return directory
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: state[n] for n in names[s::shards]}
    write_safetensors(directory / file, part, dtype=dtype)
    weight_map.update(dict.fromkeys(part, file))
  (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  return directory


def assert_trees_equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    if isinstance(a[k], dict):
      assert_trees_equal(a[k], b[k])
    else:
      assert a[k].dtype == b[k].dtype, k
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ------------------------------------------------------------------ configs of the fixtures

EXPECTED = {
    "llama": dict(family="llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rope_scaling=None,
                  layer_windows=(0, 0, 0), tie_embeddings=False, attn_scale=0.25, embed_scale=1.0),
    "llama_rope_linear": dict(max_position=1024, rope_scaling=RopeScaling("linear", 4.0, 256)),
    "llama_rope_llama3": dict(max_position=2048, rope_scaling=RopeScaling("llama3", 8.0, 256, low_freq_factor=1.0,
                                                                          high_freq_factor=4.0)),
    "llama_rope_yarn": dict(rope_theta=500.0, rope_scaling=RopeScaling("yarn", 4.0, 64, beta_fast=32.0, beta_slow=1.0)),
    "mistral": dict(family="llama", num_kv_heads=1, layer_windows=(16, 16), rope_local_theta=None),
    "qwen2": dict(family="qwen2", qkv_bias=True, head_dim=16, num_heads=6, tie_embeddings=True, rope_theta=1e6,
                  norm_eps=1e-6, layer_windows=(0, 0)),
    "gemma3": dict(family="gemma3", head_dim=32, num_kv_heads=1, qk_norm=True, sandwich_norms=True,
                   activation="gelu_tanh", embed_scale=8.0, attn_scale=24**-0.5, layer_windows=(8, 0, 8, 0),
                   rope_theta=1e6, rope_local_theta=1e4, rope_scaling=RopeScaling("linear", 4.0, 256),
                   final_logit_softcap=10.0, tie_embeddings=True, qkv_bias=False),
}


def test_every_fixture_has_expectations():
  assert set(NAMES) == set(EXPECTED)


@pytest.mark.parametrize("name", NAMES)
def test_config_from_fixture(name):
  hf_config, _ = fixture(name)
  cfg = config_from_hf(hf_config, name=name)
  assert cfg.name == name and cfg.dtype == "float32"
  assert cfg.vocab_size == hf_config["vocab_size"] and cfg.hidden_size == hf_config["hidden_size"]
  for field, value in EXPECTED[name].items():
    expected = pytest.approx(value) if isinstance(value, float) else value
    assert getattr(cfg, field) == expected, field


def test_config_accepts_a_pretrained_config_object():
  transformers = pytest.importorskip("transformers")
  hf_config, _ = fixture("gemma3")
  obj = transformers.Gemma3TextConfig.from_dict(hf_config)
  assert config_from_hf(obj, name="g") == config_from_hf(hf_config, name="g")


# ------------------------------------------------- configs as hub checkpoints spell them (legacy keys)

GEMMA3_270M = {  # google/gemma-3-270m config.json (transformers 4.5x spelling)
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "sliding_window": 512, "_sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "attention_bias": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
                   + ["sliding_attention"] * 5 + ["full_attention"],
}


def test_gemma3_270m_legacy_config():
  cfg = config_from_hf(GEMMA3_270M, name="gemma-3-270m", dtype="bfloat16")
  assert cfg.global_layers == (5, 11, 17)
  assert set(cfg.layer_windows) == {0, 512}
  assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4 and cfg.rope_scaling is None
  assert cfg.attn_scale == 256**-0.5 and cfg.embed_scale == math.sqrt(640)
  assert cfg.final_logit_softcap is None and cfg.tie_embeddings and cfg.dtype == "bfloat16"
  assert cfg.max_position == 32768 and cfg.max_context() == 32768


def test_gemma3_multimodal_config_uses_text_config_and_sliding_window_pattern():
  text = {k: v for k, v in GEMMA3_270M.items() if k not in ("layer_types", "architectures")}
  text.update(rope_scaling={"factor": 8.0, "rope_type": "linear"}, max_position_embeddings=131072,
              sliding_window_pattern=6, num_hidden_layers=12)
  cfg = config_from_hf({"model_type": "gemma3", "text_config": text}, name="gemma-3-4b")
  assert cfg.family == "gemma3" and cfg.global_layers == (5, 11)
  assert cfg.rope_scaling == RopeScaling("linear", 8.0, 16384)  # global layers only: local base stays 1e4
  assert cfg.rope_local_theta == 1e4 and cfg.max_context() == 131072


def test_llama31_llama3_scaling():
  cfg = config_from_hf({
      "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
      "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  }, name="llama-3.1-8b")
  assert cfg.head_dim == 128 and cfg.group_size == 4 and cfg.rope_theta == 5e5
  assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
  assert cfg.max_context() == 131072


QWEN25 = {  # Qwen2.5-0.5B-Instruct config.json, shapes as in DESIGN.md
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "use_sliding_window": False,
    "sliding_window": 32768, "max_window_layers": 21, "hidden_act": "silu",
}


def test_qwen25_config_and_yarn():
  cfg = config_from_hf(QWEN25, name="qwen2.5-0.5b")
  assert cfg.family == "qwen2" and cfg.head_dim == 64 and cfg.group_size == 7 and cfg.qkv_bias
  assert cfg.layer_windows == (0,) * 24  # use_sliding_window=False wins over sliding_window
  yarn = config_from_hf({**QWEN25, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}}, name="q")
  assert yarn.rope_scaling == RopeScaling("yarn", 4.0, 32768)
  assert yarn.max_context() == 131072


def test_yarn_attention_factor_variants():
  base = dict(QWEN25, max_position_embeddings=4096)
  explicit = config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5,
                                                      "beta_fast": 16, "beta_slow": 2,
                                                      "original_max_position_embeddings": 2048}}, name="q")
  assert explicit.rope_scaling == RopeScaling("yarn", 2.0, 2048, beta_fast=16.0, beta_slow=2.0, attention_factor=1.5)
  mscale = config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                    "mscale_all_dim": 0.5, "original_max_position_embeddings": 1024}},
                          name="q")
  expected = (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
  assert mscale.rope_scaling.attention_factor == pytest.approx(expected)


def test_linear_and_dynamic_scaling_lengths():
  llama = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8192}
  linear = config_from_hf({**llama, "rope_scaling": {"type": "linear", "factor": 4.0}}, name="l")
  assert linear.rope_scaling == RopeScaling("linear", 4.0, 2048) and linear.max_context() == 8192
  dynamic = config_from_hf({**llama, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, name="d")
  assert dynamic.rope_scaling == RopeScaling("dynamic", 2.0, 8192) and dynamic.max_context() == 16384
  assert dynamic.num_kv_heads == 4  # num_key_value_heads defaults to num_attention_heads


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "activation"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                           "original_max_position_embeddings": 128}}, "longrope"),
    ],
)
def test_unsupported_llama_features(change, match):
  hf_config, _ = fixture("llama")
  with pytest.raises(ValueError, match=match):
    config_from_hf({**hf_config, **change}, name="bad")


def test_unsupported_gemma_and_mistral_features():
  gemma, _ = fixture("gemma3")
  with pytest.raises(ValueError, match="attn_logit_softcapping"):
    config_from_hf({**gemma, "attn_logit_softcapping": 50.0}, name="bad")
  mistral, _ = fixture("mistral")
  with pytest.raises(ValueError, match="sliding-window"):  # kvjax scales global layers only
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    config_from_hf({**mistral, "rope_parameters": scaled}, name="bad")
  with pytest.raises(ValueError, match="dtype"):
    config_from_hf(mistral, name="bad", dtype="int8")


def test_mistral_without_window_is_global():
  mistral, _ = fixture("mistral")
  assert config_from_hf({**mistral, "sliding_window": None}, name="m").layer_windows == (0, 0)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="checks the torch-free path")
def test_config_and_loading_do_not_import_torch():
  code = (
      "import sys, json, numpy as np\n"
      "from models.hf_weights import config_from_hf, params_from_hf_state_dict\n"
      f"d = np.load({str(FIXTURES / 'gemma3.npz')!r})\n"
      "cfg = config_from_hf(json.loads(str(d['hf_config'])), name='g')\n"
      "params_from_hf_state_dict({k: d[k] for k in d.files if k.startswith('model.')}, cfg)\n"
      "assert 'torch' not in sys.modules\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parent.parent)


# ------------------------------------------------------------------- state dicts → pytree


@pytest.mark.parametrize("name", NAMES)
def test_params_match_param_shapes(name):
  hf_config, state = fixture(name)
  cfg = config_from_hf(hf_config, name=name)
  params = params_from_hf_state_dict(state, cfg)
  shapes = param_shapes(cfg)
  assert params.keys() == shapes.keys() and params["layers"].keys() == shapes["layers"].keys()
  for key in ("embed", "final_norm") + (() if cfg.tie_embeddings else ("lm_head",)):
    assert params[key].shape == shapes[key] and params[key].dtype == np.float32
  for key, shape in shapes["layers"].items():
    assert params["layers"][key].shape == shape and params["layers"][key].dtype == np.float32, key
  # Linear weights are transposed to [in, out] and stacked; norms folded for Gemma.
  np.testing.assert_array_equal(params["layers"]["wq"][1], state["model.layers.1.self_attn.q_proj.weight"].T)
  np.testing.assert_array_equal(params["layers"]["w_down"][0], state["model.layers.0.mlp.down_proj.weight"].T)
  offset = 1.0 if cfg.family == "gemma3" else 0.0
  np.testing.assert_array_equal(params["final_norm"], offset + state["model.norm.weight"])
  if cfg.family == "gemma3":
    np.testing.assert_array_equal(params["layers"]["q_norm"][2], 1.0 + state["model.layers.2.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(params["layers"]["pre_mlp_norm"][3],
                                  1.0 + state["model.layers.3.pre_feedforward_layernorm.weight"])
  else:
    np.testing.assert_array_equal(params["layers"]["pre_mlp_norm"][0],
                                  state["model.layers.0.post_attention_layernorm.weight"])
  if cfg.qkv_bias:
    np.testing.assert_array_equal(params["layers"]["bk"][1], state["model.layers.1.self_attn.k_proj.bias"])
  if not cfg.tie_embeddings:
    np.testing.assert_array_equal(params["lm_head"], state["lm_head.weight"].T)


def test_bfloat16_output():
  hf_config, state = fixture("gemma3")
  cfg = config_from_hf(hf_config, name="g", dtype="bfloat16")
  params = params_from_hf_state_dict(state, cfg)
  assert params["layers"]["wq"].dtype == ml_dtypes.bfloat16
  # Gemma's multiplier 1 + w, kept float32 as HF computes it (in bfloat16 a small w rounded away).
  expected = 1.0 + state["model.layers.0.input_layernorm.weight"].astype(np.float32)
  assert params["layers"]["input_norm"].dtype == np.float32 and params["final_norm"].dtype == np.float32
  np.testing.assert_array_equal(params["layers"]["input_norm"][0], expected)


def test_ignored_and_unexpected_tensors():
  hf_config, state = fixture("llama")
  cfg = config_from_hf(hf_config, name="l")
  reference = params_from_hf_state_dict(state, cfg)
  extra = dict(state)
  extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  extra["model.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  assert_trees_equal(params_from_hf_state_dict(extra, cfg), reference)
  extra["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
  with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"):
    params_from_hf_state_dict(extra, cfg)
  layer3 = dict(state, **{"model.layers.3.input_layernorm.weight": np.ones(64, np.float32)})
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.3"):
    params_from_hf_state_dict(layer3, cfg)


@pytest.mark.parametrize("missing", ["model.layers.2.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight"])
def test_missing_tensor(missing):
  hf_config, state = fixture("llama")
  cfg = config_from_hf(hf_config, name="l")
  with pytest.raises(ValueError, match=f"missing tensor '{missing}'"):
    params_from_hf_state_dict({k: v for k, v in state.items() if k != missing}, cfg)


def test_missing_bias_and_qk_norm():
  for name, missing in [("qwen2", "model.layers.1.self_attn.v_proj.bias"),
                        ("gemma3", "model.layers.3.self_attn.k_norm.weight")]:
    hf_config, state = fixture(name)
    with pytest.raises(ValueError, match=f"missing tensor '{missing}'"):
      params_from_hf_state_dict({k: v for k, v in state.items() if k != missing}, config_from_hf(hf_config, name=name))


def test_misshaped_tensor():
  hf_config, state = fixture("llama")
  cfg = config_from_hf(hf_config, name="l")
  bad = dict(state, **{"model.layers.1.self_attn.k_proj.weight": state["model.layers.1.self_attn.k_proj.weight"].T})
  message = r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(64, 32\), expected \(32, 64\)"
  with pytest.raises(ValueError, match=message):
    params_from_hf_state_dict(bad, cfg)
  # A config that disagrees with the checkpoint (wrong vocab) is caught the same way.
  with pytest.raises(ValueError, match="embed_tokens.weight' has shape"):
    params_from_hf_state_dict(state, dataclasses.replace(cfg, vocab_size=300))


def test_tied_lm_head_is_accepted_when_equal_and_refused_when_not():
  hf_config, state = fixture("qwen2")
  cfg = config_from_hf(hf_config, name="q")
  reference = params_from_hf_state_dict(state, cfg)
  assert "lm_head" not in reference
  same = dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"].copy()})
  assert_trees_equal(params_from_hf_state_dict(same, cfg), reference)
  with pytest.raises(ValueError, match="differs from the embeddings"):
    params_from_hf_state_dict(dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"] + 1}), cfg)


@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_names(layout):
  hf_config, state = fixture("gemma3")
  cfg = config_from_hf(hf_config, name="g")
  renamed = {layout + k[len("model."):]: v for k, v in state.items()}
  renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3), np.float32)
  renamed["model.multi_modal_projector.mm_input_projection_weight"] = np.zeros((4, 3), np.float32)
  assert_trees_equal(params_from_hf_state_dict(renamed, cfg), params_from_hf_state_dict(state, cfg))


# ---------------------------------------------------------------- safetensors directories


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shards", [1, 3])
def test_directory_round_trip(tmp_path, name, shards):
  hf_config, state = fixture(name)
  directory = write_checkpoint(tmp_path / name, hf_config, state, shards=shards)
  cfg, params = load_hf_directory(directory)
  assert cfg == config_from_hf(hf_config, name=name)  # name defaults to the directory's
  assert_trees_equal(params, params_from_hf_state_dict(state, cfg))


@pytest.mark.parametrize("file_dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
def test_half_precision_files(tmp_path, file_dtype, out_dtype):
  hf_config, state = fixture("gemma3")
  directory = write_checkpoint(tmp_path / "g", hf_config, state, dtype=file_dtype, shards=2)
  cfg, params = load_hf_directory(directory, dtype=out_dtype, name="gemma-half")
  assert cfg.dtype == out_dtype and cfg.name == "gemma-half"
  rounded = {k: v.astype(file_dtype) for k, v in state.items()}
  assert_trees_equal(params, params_from_hf_state_dict(rounded, cfg))


def test_reader_matches_the_safetensors_package(tmp_path):
  st_numpy = pytest.importorskip("safetensors.numpy")
  _, state = fixture("qwen2")
  st_numpy.save_file(state, str(tmp_path / "a.safetensors"))
  loaded = read_safetensors(tmp_path / "a.safetensors")
  assert loaded.keys() == state.keys()
  for k in state:
    np.testing.assert_array_equal(loaded[k], state[k])
  # ...and the package reads what the test's writer writes (so the writer is a valid reference).
  write_safetensors(tmp_path / "b.safetensors", {"x": np.arange(6, dtype=np.float16).reshape(2, 3)})
  np.testing.assert_array_equal(st_numpy.load_file(str(tmp_path / "b.safetensors"))["x"],
                                np.arange(6, dtype=np.float16).reshape(2, 3))


def test_reader_bfloat16_values(tmp_path):
  x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
  write_safetensors(tmp_path / "x.safetensors", {"x": x, "empty": np.zeros((0, 4), np.float32)})
  loaded = read_safetensors(tmp_path / "x.safetensors")
  assert loaded["x"].dtype == ml_dtypes.bfloat16 and loaded["empty"].shape == (0, 4)
  np.testing.assert_array_equal(loaded["x"], x)


def _good_file(tmp_path):
  path = tmp_path / "model.safetensors"
  write_safetensors(path, {"a": np.ones((4, 4), np.float32), "b": np.zeros(3, np.float32)})
  return path


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda raw: raw[:5], "truncated"),
        (lambda raw: raw[:-8], "truncated"),  # data cut short
        (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "header length"),
        (lambda raw: raw[:8] + b"x" + raw[9:], "corrupt safetensors header"),
        (lambda raw: raw[:8] + raw[8:].replace(b'"F32"', b'"I64"', 1), "only F32, F16 and BF16"),
        (lambda raw: raw[:8] + raw[8:].replace(b'"shape": [4, 4]', b'"shape": [4, 5]', 1), "corrupt"),
        (lambda raw: raw[:8] + raw[8:].replace(b'"data_offsets"', b'"data_offsetz"', 1), "corrupt"),
    ],
)
def test_corrupt_files_name_the_file(tmp_path, corrupt, match):
  path = _good_file(tmp_path)
  read_safetensors(path)  # intact
  path.write_bytes(corrupt(path.read_bytes()))
  with pytest.raises(ValueError, match=match) as info:
    read_safetensors(path)
  assert str(path) in str(info.value)


def test_corrupt_shard_in_a_directory(tmp_path):
  hf_config, state = fixture("mistral")
  directory = write_checkpoint(tmp_path / "m", hf_config, state, shards=2)
  shard = directory / "model-00002-of-00002.safetensors"
  shard.write_bytes(shard.read_bytes()[:1000])
  with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
    load_hf_directory(directory)


def test_directory_errors(tmp_path):
  hf_config, state = fixture("llama")
  with pytest.raises(ValueError, match="config.json"):
    load_hf_directory(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(ValueError, match="no \\*.safetensors"):
    load_hf_directory(tmp_path)
  directory = write_checkpoint(tmp_path / "sharded", hf_config, state, shards=2)
  (directory / "model-00001-of-00002.safetensors").unlink()
  with pytest.raises(ValueError, match="missing"):
    load_hf_directory(directory)
  partial = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.q_proj.weight"}
  with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.q_proj.weight'"):
    load_hf_directory(write_checkpoint(tmp_path / "partial", hf_config, partial))


def test_loaded_params_are_writable_copies(tmp_path):
  hf_config, state = fixture("qwen2")
  _, params = load_hf_directory(write_checkpoint(tmp_path / "q", hf_config, state))
  assert isinstance(params["embed"], np.ndarray) and not isinstance(params["embed"], np.memmap)
  assert params["embed"].flags.writeable and params["final_norm"].flags.writeable


def test_model_config_type():
  hf_config, _ = fixture("llama")
  assert isinstance(config_from_hf(hf_config, name="l"), ModelConfig)
