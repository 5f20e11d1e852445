"""GGUF files -> (ModelConfig, layer-stacked params), with NumPy only.

Parses the header and metadata itself (`GGUFFile`, over a read-only mmap), dequantizes each
tensor with `gguf.quants.dequantize` (NumPy), and lays the result out as `models.config`
describes.

Three GGUF conventions are undone here:

* Shapes: GGUF lists dimensions fastest-first (ggml `ne` order); the reader's NumPy view is
  already reversed, so a projection comes out [out, in] (as in HF) and is transposed to the
  [in, out] layout of the parameter pytree.
* Q/K row permutation (llama architecture only): llama.cpp's HF converter reorders the
  output rows of `q_proj` and `k_proj` so its interleaved ("GPT-J" / NORM) RoPE computes
  what HF's rotate-half RoPE does:
      w_gguf = w_hf.reshape(n, 2, d // 2, in).swapaxes(1, 2).reshape(n * d, in)
  with n = num_heads for Q and num_kv_heads for K, d = head_dim. The inverse is applied here:
      w_hf = w_gguf.reshape(n, d // 2, 2, in).swapaxes(1, 2).reshape(n * d, in)
  qwen2 and gemma3 run NEOX (rotate-half) RoPE in llama.cpp and are stored unpermuted.
* Gemma norms: the converter already adds 1 to every `*norm.weight` of Gemma 3 (HF applies
  `x * (1 + w)`), so GGUF holds the effective multiplier and it is used as is.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import mmap
import os
import re
import struct
from typing import Any

import numpy as np

from models.config import ModelConfig, RopeScaling, leaf_dtype, param_shapes

_GGUF_MAGIC = b"GGUF"
_SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")

# GGUF per-layer tensor name -> parameter pytree name ("T": stored [out, in], transpose).
_LAYER_TENSORS = {
    "attn_norm.weight": ("input_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "attn_q_norm.weight": ("q_norm", False),
    "attn_k_norm.weight": ("k_norm", False),
    "attn_output.weight": ("wo", True),
    "post_attention_norm.weight": ("post_attn_norm", False),
    "ffn_norm.weight": ("pre_mlp_norm", False),
    "post_ffw_norm.weight": ("post_mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def sha256_file(path: str | os.PathLike, *, chunk_bytes: int = 1 << 24) -> str:
  """Hex sha256 of a file, read in chunks (never the whole file in memory)."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(chunk_bytes):
      h.update(chunk)
  return h.hexdigest()


def np_dtype(dtype: str) -> np.dtype:
  """NumPy dtype for a config dtype name ("float32", "bfloat16", "float16")."""
  if dtype == "bfloat16":
    import ml_dtypes  # ships with jax

    return np.dtype(ml_dtypes.bfloat16)
  if dtype in ("float32", "float16"):
    return np.dtype(dtype)
  raise ValueError(f"unsupported {dtype=}; expected float32, bfloat16 or float16")


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor's header entry. `shape` is ggml's `ne` order (fastest dimension first)."""

  name: str
  shape: tuple[int, ...]
  qtype: Any  # gguf.GGMLQuantizationType
  offset: int  # absolute byte offset in the file
  nbytes: int
  _buf: Any = dataclasses.field(repr=False, compare=False)

  @property
  def raw(self) -> np.ndarray:
    """The stored bytes as uint8 [*reversed(ne)[:-1], row_bytes] (what `gguf.quants` takes)."""
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
    row_bytes = self.shape[0] // block * type_size
    rows = tuple(int(x) for x in reversed(self.shape[1:]))
    return np.frombuffer(self._buf, np.uint8, self.nbytes, self.offset).reshape(*rows, row_bytes)

  def dequantize(self) -> np.ndarray:
    """float32 values with NumPy shape reversed(ne): a projection comes out [out, in]."""
    import gguf

    a = gguf.quants.dequantize(self.raw, self.qtype)
    return np.asarray(a, np.float32).reshape(tuple(int(x) for x in reversed(self.shape)))


class GGUFFile:
  """A GGUF file's metadata and tensor directory, parsed in Python over a read-only mmap.

  `gguf.GGUFReader` builds a NumPy object per metadata string (28 s for Gemma 3's 262K-token
  vocabulary on this machine); this parser reads the same header in well under a second and
  leaves tensor bytes in the mmap until they are dequantized.

  Attributes:
    path: the file.
    metadata: every key -> value (strings, numbers, lists; numeric arrays as NumPy arrays).
    tensors: GGUFTensor per tensor, in file order.
  """

  def __init__(self, path: str | os.PathLike):
    import gguf

    self.path = os.fspath(path)
    self.size = os.path.getsize(self.path)
    with open(self.path, "rb") as f:
      self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
    buf, pos = self._buf, 0
    magic, version = bytes(buf[0:4]), struct.unpack_from("<I", buf, 4)[0]
    if magic != _GGUF_MAGIC:
      raise ValueError(f"{self.path!r} is not a GGUF file (magic {magic!r})")
    if version not in (2, 3):
      raise ValueError(f"{self.path!r}: unsupported GGUF version {version}")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    if n_tensors > self.size or n_kv > self.size:
      raise ValueError(f"{self.path!r}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")

    def string(pos):
      (n,) = struct.unpack_from("<Q", buf, pos)
      if pos + 8 + n > self.size:
        raise ValueError("string runs past the end of the file")
      return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

    def value(vtype, pos):
      if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
      if vtype == _STRING:
        return string(pos)
      if vtype == _ARRAY:
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _NP_SCALAR:
          dt = np.dtype(_NP_SCALAR[etype])
          if pos + n * dt.itemsize > self.size:
            raise ValueError("array runs past the end of the file")
          arr = np.frombuffer(buf, dt, n, pos).copy()
          return (arr.astype(bool) if etype == 7 else arr), pos + n * dt.itemsize
        out = []
        for _ in range(n):
          v, pos = value(etype, pos)
          out.append(v)
        return out, pos
      raise ValueError(f"unknown metadata value type {vtype}")

    self.metadata: dict[str, Any] = {}
    for _ in range(n_kv):
      key, pos = string(pos)
      (vtype,) = struct.unpack_from("<I", buf, pos)
      self.metadata[key], pos = value(vtype, pos + 4)
    infos = []
    for _ in range(n_tensors):
      name, pos = string(pos)
      (n_dims,) = struct.unpack_from("<I", buf, pos)
      if n_dims > 8:
        raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
      ne = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
      qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
      pos += 4 + 8 * n_dims + 12
      infos.append((name, tuple(int(x) for x in ne), qtype, offset))
    align = int(self.metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    self.tensors: list[GGUFTensor] = []
    for name, ne, qtype, offset in infos:
      try:
        qt = gguf.GGMLQuantizationType(qtype)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
      except (ValueError, KeyError) as e:
        raise ValueError(f"tensor {name!r} has unknown ggml type {qtype}") from e
      n = math.prod(ne)
      if ne[0] % block:
        raise ValueError(f"tensor {name!r} row of {ne[0]} is not a multiple of the {qt.name} block {block}")
      nbytes = n // block * type_size
      start = data_start + offset
      if start + nbytes > self.size:
        raise ValueError(f"tensor {name!r} ends at byte {start + nbytes}, past the file's {self.size} bytes (truncated)")
      self.tensors.append(GGUFTensor(name, ne, qt, start, nbytes, self._buf))

  def get(self, key: str, default=None):
    return self.metadata.get(key, default)


def open_gguf(path: str | os.PathLike, *, expected_sha256: str | None = None) -> GGUFFile:
  """Opens a GGUF file, checking checksum, magic, header and tensor extents first.

  Args:
    path: the .gguf file.
    expected_sha256: when given, the file's sha256 must match (checked before parsing).

  Returns:
    A GGUFFile (memory-mapped; no tensor is read yet).

  Raises:
    ValueError: naming the path, for a missing file, a checksum mismatch, or a truncated,
      corrupt or non-GGUF file.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"GGUF file {path!r} does not exist")
  if expected_sha256 is not None:
    got = sha256_file(path)
    if got != expected_sha256.lower():
      raise ValueError(f"GGUF file {path!r} has sha256 {got}, expected {expected_sha256} (corrupt or wrong file)")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != _GGUF_MAGIC:
    raise ValueError(f"{path!r} is not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
  try:
    return GGUFFile(path)
  except ValueError as e:
    msg = str(e)
    raise ValueError(msg if path in msg else f"GGUF file {path!r} is truncated or corrupt: {msg}") from e
  except (struct.error, IndexError, OverflowError, MemoryError) as e:
    raise ValueError(f"GGUF file {path!r} is truncated or corrupt: {type(e).__name__}: {e}") from e


def _f32(x) -> float:
  """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
  return float(f"{float(x):.7g}")


def _llama3_scaling_from_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> RopeScaling:
  """Recovers Llama-3.1's RoPE scaling from the `rope_freqs` tensor llama.cpp stores.

  llama.cpp divides each frequency by rope_freqs[i]; Llama-3.1/3.2 use factor = max, with
  low/high freq factors 1/4 and an original context of 8192 (the only published values).
  """
  factor = float(freqs.max())
  low, high, orig = 1.0, 4.0, 8192
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / inv
  smooth = (orig / wavelen - low) / (high - low)
  expected = np.where(
      wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
  )
  if not np.allclose(expected, freqs, rtol=1e-3):
    raise ValueError(
        f"rope_freqs tensor does not match Llama-3 scaling (factor {factor}, low 1, high 4, original 8192): "
        f"got {freqs[:4]}... expected {expected[:4]}..."
    )
  return RopeScaling(kind="llama3", factor=factor, original_max_position=orig, low_freq_factor=low, high_freq_factor=high)


def config_from_gguf(reader, *, name: str, dtype: str = "float32") -> ModelConfig:
  """Builds the ModelConfig a GGUF file describes (no tensor is dequantized)."""
  md = reader.metadata
  arch = md.get("general.architecture")
  if arch not in _SUPPORTED_ARCHS:
    raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {_SUPPORTED_ARCHS}")

  def get(key, default=None, *, required=False):
    full = f"{arch}.{key}"
    if full in md:
      return md[full]
    if required:
      raise ValueError(f"GGUF metadata lacks {full!r}")
    return default

  tensors = {t.name: t for t in reader.tensors}
  hidden = int(get("embedding_length", required=True))
  num_layers = int(get("block_count", required=True))
  num_heads = int(get("attention.head_count", required=True))
  num_kv_heads = get("attention.head_count_kv", num_heads)
  if isinstance(num_kv_heads, (list, np.ndarray)):  # per-layer in some files (the reader gives arrays)
    num_kv_heads = [int(n) for n in num_kv_heads]
    if len(set(num_kv_heads)) != 1:
      raise ValueError(f"per-layer KV head counts {num_kv_heads} are not supported")
    num_kv_heads = num_kv_heads[0]
  num_kv_heads = int(num_kv_heads)
  head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or hidden // num_heads)
  if arch == "gemma3":
    head_dim = int(get("attention.key_length", 0) or hidden // num_heads)
  if "token_embd.weight" not in tensors:
    raise ValueError("GGUF file has no token_embd.weight")
  vocab = int(tensors["token_embd.weight"].shape[1])  # ne = [hidden, vocab]
  theta = _f32(get("rope.freq_base", 10000.0))

  scaling = None
  kind = get("rope.scaling.type")
  factor = get("rope.scaling.factor")
  context = int(get("context_length", required=True))
  if kind in ("linear", "yarn") and factor and float(factor) != 1.0:
    orig = int(get("rope.scaling.original_context_length", 0) or context / float(factor))
    extra = {}
    if kind == "yarn":
      extra = dict(
          beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
          beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
      )
      attn = get("rope.scaling.attn_factor")
      if attn is not None:
        extra["attention_factor"] = float(attn)
    scaling = RopeScaling(kind=kind, factor=float(factor), original_max_position=orig, **extra)
  elif kind not in (None, "none", "linear", "yarn"):
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
  if "rope_freqs.weight" in tensors:
    freqs = tensors["rope_freqs.weight"].dequantize().astype(np.float64).reshape(-1)
    scaling = _llama3_scaling_from_freqs(freqs, head_dim, theta)

  common = dict(
      name=name,
      family=arch,
      vocab_size=vocab,
      hidden_size=hidden,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      intermediate_size=int(get("feed_forward_length", required=True)),
      max_position=context,
      rope_theta=theta,
      norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_embeddings="output.weight" not in tensors,
      rope_scaling=scaling,
      dtype=dtype,
  )
  if arch == "qwen2":
    common["qkv_bias"] = "blk.0.attn_q.bias" in tensors
  if arch == "llama":
    common["qkv_bias"] = "blk.0.attn_q.bias" in tensors
  if arch == "gemma3":
    window = int(get("attention.sliding_window", 512))
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, np.ndarray)):  # per-layer booleans: True = sliding
      windows = tuple(window if bool(p) else 0 for p in pattern)
    else:
      # llama.cpp's set_swa_pattern(n): every n-th layer (il % n == n - 1) is global.
      windows = tuple(0 if (i % int(pattern)) == int(pattern) - 1 else window for i in range(num_layers))
    # query_pre_attn_scalar is not in GGUF; llama.cpp: head_dim, except 27B (62 layers): hidden / heads.
    qpas = hidden // num_heads if num_layers == 62 else head_dim
    softcap = get("final_logit_softcapping")
    common.update(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        attn_scale=qpas**-0.5,
        layer_windows=windows,
        rope_local_theta=10000.0,  # llama.cpp: rope_freq_base_train_swa for Gemma 3
        final_logit_softcap=float(softcap) if softcap else None,
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
    )
  return ModelConfig(**common)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation of a [n_heads * head_dim, in] weight (or bias).

  GGUF rows of one head are ordered (j, half) for j < head_dim / 2 (interleaved RoPE pairs);
  HF's rotate-half wants (half, j): w.reshape(n, d/2, 2, ...).swapaxes(1, 2).
  """
  rows = w.shape[0]
  d = rows // n_heads
  assert d * n_heads == rows and d % 2 == 0, (w.shape, n_heads)
  return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    name: str | None = None,
    expected_sha256: str | None = None,
) -> tuple[ModelConfig, dict]:
  """Loads a GGUF file into (ModelConfig, params) with host NumPy arrays.

  Args:
    path: a .gguf file of architecture llama, qwen2 or gemma3.
    dtype: storage dtype of the returned arrays ("float32", "bfloat16", "float16"); also
      recorded as `cfg.dtype`.
    name: `cfg.name`; defaults to the file name without ".gguf".
    expected_sha256: when given, verified (streaming) before anything is parsed.

  Returns:
    (cfg, params): params is the layer-stacked pytree of `models.config` as NumPy arrays
    (the caller moves them to the device).

  Raises:
    ValueError: naming the path, for a checksum mismatch, a truncated/corrupt/non-GGUF file,
      an unsupported architecture, or tensors that do not fit the config.
  """
  path = os.fspath(path)
  np_dtype(dtype)  # a bad dtype fails before the file is read
  reader = open_gguf(path, expected_sha256=expected_sha256)
  return load_gguf_reader(reader, dtype=dtype, name=name)


def load_gguf_reader(reader: GGUFFile, *, dtype: str = "float32", name: str | None = None) -> tuple[ModelConfig, dict]:
  """`load_gguf` on an already opened (and checked) GGUFFile (see `open_gguf`)."""
  path = reader.path
  out_dtype = np_dtype(dtype)
  if name is None:
    name = os.path.basename(path).removesuffix(".gguf")
  try:
    cfg = config_from_gguf(reader, name=name, dtype=dtype)
  except ValueError as e:
    raise ValueError(f"{path!r}: {e}") from e
  shapes = param_shapes(cfg)
  L = cfg.num_layers
  permute = cfg.family == "llama"
  heads_of = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads, "bk": cfg.num_kv_heads}

  layers = {k: np.empty(s, np_dtype(leaf_dtype(k, dtype))) for k, s in shapes["layers"].items()}
  filled = {k: np.zeros(L, bool) for k in layers}
  params: dict[str, Any] = {"layers": layers}

  def dequant(t: GGUFTensor) -> np.ndarray:
    a = t.dequantize()
    if not np.isfinite(a).all():
      raise ValueError(f"{path!r}: tensor {t.name} has non-finite values (corrupt file)")
    return a

  jobs, unexpected = [], []
  for t in reader.tensors:
    m = _LAYER_RE.match(t.name)
    if m:
      layer, suffix = int(m.group(1)), m.group(2)
      if suffix not in _LAYER_TENSORS or _LAYER_TENSORS[suffix][0] not in layers or layer >= L:
        unexpected.append(t.name)
      else:
        jobs.append((t, layer, *_LAYER_TENSORS[suffix]))
    elif t.name in ("token_embd.weight", "output.weight", "output_norm.weight"):
      jobs.append((t, None, None, None))
    elif t.name != "rope_freqs.weight":  # rope_freqs is folded into cfg.rope_scaling
      unexpected.append(t.name)
  if unexpected:
    raise ValueError(f"{path!r}: tensors not understood for {cfg.family}: {unexpected[:8]}")

  def run(job):
    t, layer, key, transpose = job
    a = dequant(t)
    if layer is None:
      if t.name == "token_embd.weight":
        params["embed"] = a.astype(out_dtype)
      elif t.name == "output.weight":
        params["lm_head"] = np.ascontiguousarray(a.T, dtype=out_dtype)
      else:
        params["final_norm"] = a.astype(np_dtype(leaf_dtype("final_norm", dtype)))
      return
    if permute and key in heads_of:
      a = unpermute_qk(a, heads_of[key])
    if transpose:
      a = a.T
    if a.shape != shapes["layers"][key][1:]:
      raise ValueError(f"{path!r}: tensor {t.name} has shape {a.shape}, expected {shapes['layers'][key][1:]}")
    layers[key][layer] = a  # cast (and transposed copy) in one pass
    filled[key][layer] = True

  # NumPy releases the GIL in the dequantization kernels: a few threads overlap them.
  workers = max(1, min(4, os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for f in [pool.submit(run, j) for j in sorted(jobs, key=lambda j: -j[0].nbytes)]:
      f.result()
  missing = [f"layers/{k}[{np.flatnonzero(~v).tolist()[:4]}]" for k, v in filled.items() if not v.all()]
  missing += [k for k in shapes if k != "layers" and k not in params]
  if missing:
    raise ValueError(f"{path!r}: GGUF lacks tensors for {missing}")
  check_shapes(cfg, params)
  return cfg, params


def check_shapes(cfg: ModelConfig, params: dict) -> None:
  """Raises ValueError unless `params` has exactly the keys and shapes of `param_shapes(cfg)`."""
  want = param_shapes(cfg)
  got_top = {k for k in params if k != "layers"}
  want_top = {k for k in want if k != "layers"}
  if got_top != want_top or set(params["layers"]) != set(want["layers"]):
    raise ValueError(
        f"param keys {sorted(got_top)} / layers {sorted(params['layers'])} != expected "
        f"{sorted(want_top)} / {sorted(want['layers'])}"
    )
  for k in want_top:
    if tuple(params[k].shape) != tuple(want[k]):
      raise ValueError(f"param {k} has shape {tuple(params[k].shape)}, expected {want[k]}")
  for k, s in want["layers"].items():
    if tuple(params["layers"][k].shape) != tuple(s):
      raise ValueError(f"param layers/{k} has shape {tuple(params['layers'][k].shape)}, expected {s}")


__all__ = ["load_gguf", "load_gguf_reader", "GGUFFile", "GGUFTensor", "config_from_gguf", "open_gguf", "unpermute_qk", "sha256_file", "check_shapes", "np_dtype"]
