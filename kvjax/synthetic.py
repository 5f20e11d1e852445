"""Synthetic long contexts: a short real prefill's statistics, a context of any length.

A real prefill of 1M tokens does not fit in a 10-minute run (for Llama-3-8B shapes its
attention alone is ~2.6e17 FLOPs), and scale benchmarks need contexts of 128K-1M tokens many
times over. `synthetic_prefill` builds such a context without running the model over it:

  * `fit_statistics` runs one real prefill of a calibration prompt (a few thousand tokens) and
    keeps, per (layer, KV head), the mean and covariance of the keys and of the values after
    RoPE, and per (layer, query head) those of the queries, all fitted on the positions
    between a real head and a real tail; plus the head and tail tokens themselves (the
    attention sinks and the recent structure), and the prompt's last hidden state.
  * `synthetic_prefill` writes a context of the requested length into a policy's prefill
    state layer by layer, as a prefill chunk would (`AttentionPolicy.write_prompt`): the
    real head at positions 0 .. head - 1, Gaussian draws with the fitted moments in the
    middle, and the real tail moved to the context's end (keys and queries rotated by the
    position shift, which RoPE composes exactly); then the policy's own `finish_prefill`
    offloads and indexes it as after a real prefill. Decode continues from the calibration
    prompt's last hidden state at the context's length.

What it is not: the middle has no content (no needle, no long-range structure), the draws are
stationary (a real key's low RoPE frequencies keep rotating past the calibration length), and
keys, values and queries are drawn independently. Search cost, scan fractions, hit and
correction rates measured on it say something about these Gaussians, not about the model:
every output of a synthetic context says "synthetic" (its metadata, bench rows). Use it for
latency and memory at scale; measure accuracy and vector statistics on real prefills.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks, kv_codec
from kvjax.generate import PrefilledContext, check_context, prefill, round_capacity
from kvjax.policies import make_policy
from kvjax.policies.base import HostBackedMixin
from kvjax.policies.full import DenseKVCache, FullAttention, write_and_attend, write_tokens
from models.config import ModelConfig
from models.decoder import weights_fingerprint
from models.rope import apply_rope, rope_tables

# Positions written for nothing: far past any capacity, and small enough that a policy's
# position arithmetic (p - sinks, p // stride) cannot overflow int32.
_DROPPED = 2**30


@dataclasses.dataclass(frozen=True)
class KVStatistics:
  """Moments and real head/tail tokens of one calibration prefill (see the module docstring).

  Attributes:
    model_name, config_hash, dtype: the model that made it (synthetic contexts refuse others).
    source: what the calibration prompt was (e.g. "essay text", "random token ids").
    calibration_len: tokens of the calibration prompt.
    k_mean, v_mean: [L, Hkv, D] float32 means of the middle positions' keys (after RoPE) / values.
    k_chol, v_chol: [L, Hkv, D, D] float32 lower Cholesky factors of their covariances.
    q_mean: [L, Hq, D] float32, q_chol: [L, Hq, D, D] float32: the same for the queries.
    head_k, head_v: [L, Hkv, head, D] the first `head` tokens; head_q: [L, Hq, head, D].
    tail_k, tail_v: [L, Hkv, tail, D] the last `tail` tokens (at their calibration positions);
      tail_q: [L, Hq, tail, D].
    last_hidden: [hidden] the calibration prompt's last hidden state (the first decoded token's).
  """

  model_name: str
  config_hash: str
  dtype: str
  source: str
  calibration_len: int
  k_mean: np.ndarray
  k_chol: np.ndarray
  v_mean: np.ndarray
  v_chol: np.ndarray
  q_mean: np.ndarray
  q_chol: np.ndarray
  head_k: np.ndarray
  head_v: np.ndarray
  head_q: np.ndarray
  tail_k: np.ndarray
  tail_v: np.ndarray
  tail_q: np.ndarray
  last_hidden: np.ndarray

  @property
  def head_len(self) -> int:
    return self.head_k.shape[2]

  @property
  def tail_len(self) -> int:
    return self.tail_k.shape[2]

  def describe(self) -> str:
    return (f"synthetic: Gaussian keys, values and queries per (layer, head) with the moments of "
            f"{self.calibration_len} tokens of {self.source}; the real first {self.head_len} and last "
            f"{self.tail_len} tokens")


# -- calibration ---------------------------------------------------------------------------


@flax.struct.dataclass
class _Recording:
  cache: DenseKVCache  # [L, B, Hkv, capacity, D]
  q: jax.Array  # [L, B, Hq, capacity, D]


@dataclasses.dataclass(frozen=True)
class _RecordingAttention(FullAttention):
  """Dense attention that also keeps every prompt query (for fit_statistics only)."""

  name: str = "full (recording queries)"

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> _Recording:
    q = jnp.zeros((cfg.num_layers, batch, cfg.num_heads, capacity, cfg.head_dim), dtype)
    return _Recording(cache=super().init_state(cfg, batch, capacity, dtype), q=q)

  def attend(self, cfg, layer, q, k, v, positions, state: _Recording):
    o, cache = write_and_attend(cfg, state.cache, layer, q, k, v, positions, implementation=self.implementation)
    return o, state.replace(cache=cache, q=write_tokens(state.q, layer, q, positions))


def _moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """x [H, n, D] -> mean [H, D] and lower Cholesky factor [H, D, D] of the covariance (float32).

  A small ridge (1e-6 of the mean variance) keeps the factorization defined for heads with
  dead dimensions."""
  x = x.astype(np.float64)
  mean = x.mean(axis=1)
  centered = x - mean[:, None]
  cov = np.matmul(centered.transpose(0, 2, 1), centered) / max(1, x.shape[1] - 1)  # BLAS, not einsum's loops
  ridge = 1e-6 * np.trace(cov, axis1=1, axis2=2)[:, None, None] / x.shape[2] + 1e-12
  chol = np.linalg.cholesky(cov + ridge * np.eye(x.shape[2]))
  return mean.astype(np.float32), chol.astype(np.float32)


def fit_statistics(
    model,
    prompt: str | Sequence[int],
    *,
    head_len: int = 512,
    tail_len: int = 1024,
    source: str | None = None,
    prefill_chunk: int = 1024,
) -> KVStatistics:
  """Prefills one calibration prompt and fits the moments of its keys, values and queries.

  Args:
    model: a loaded model (one device).
    prompt: text or token ids; its length must exceed head_len + tail_len by at least 2 *
      head_dim positions, so every covariance is fitted on more samples than dimensions.
    head_len: real tokens kept at the start (cover the policies' sinks: 512 for freekv).
    tail_len: real tokens kept at the end (cover the device window, 512 + a page).
    source: words for what the prompt is, carried into every description.
    prefill_chunk: prompt tokens per prefill step.
  """
  head_len, tail_len = checks.integer(head_len, "head_len", low=0), checks.integer(tail_len, "tail_len", low=1)
  prefill_chunk = checks.integer(prefill_chunk, "prefill_chunk", low=1)
  if getattr(model, "mesh", None) is not None:
    raise ValueError("fit_statistics runs on a model on one device, not a sharded one")
  cfg = model.cfg
  if not isinstance(prompt, str):  # token ids: their length is known before the prefill
    _check_middle(len(checks.token_ids(prompt, "prompt")), head_len, tail_len, cfg.head_dim)
  context = prefill(model, prompt, max_new_tokens=1, policy=_RecordingAttention(),
                                 prefill_chunk=prefill_chunk)
  if len(context.prompt_lengths) != 1:
    raise ValueError(f"fit_statistics takes one prompt, got {len(context.prompt_lengths)}")
  n = context.prompt_lengths[0]
  try:
    _check_middle(n, head_len, tail_len, cfg.head_dim)  # a text prompt's length is known once tokenized
  except ValueError:
    context.close()
    raise
  middle = n - head_len - tail_len
  state = context.state
  fields: dict[str, list] = {name: [] for name in ("k", "v", "q")}
  for layer in range(cfg.num_layers):  # one layer on the host at a time
    for name, array in (("k", state.cache.k), ("v", state.cache.v), ("q", state.q)):
      x = np.asarray(jax.device_get(array[layer, 0, :, :n]), np.float32)  # [H, n, D]
      fields[name].append((x[:, :head_len], x[:, head_len:n - tail_len], x[:, n - tail_len:]))
  out = {}
  for name, parts in fields.items():
    means, chols = zip(*(_moments(middle_x) for _, middle_x, _ in parts))
    out[f"{name}_mean"], out[f"{name}_chol"] = np.stack(means), np.stack(chols)
    out[f"head_{name}"] = np.stack([head for head, _, _ in parts]).astype(jnp.dtype(cfg.dtype))
    out[f"tail_{name}"] = np.stack([tail for _, _, tail in parts]).astype(jnp.dtype(cfg.dtype))
  if source is None:
    source = "text" if isinstance(prompt, str) else "token ids"
  last_hidden = np.asarray(context.last_hidden[0])
  context.close()
  return KVStatistics(model_name=cfg.name, config_hash=cfg.config_hash(), dtype=cfg.dtype, source=source,
                      calibration_len=n, last_hidden=last_hidden, **out)


def _check_middle(n: int, head_len: int, tail_len: int, head_dim: int) -> None:
  middle = n - head_len - tail_len
  if middle < 2 * head_dim:
    raise ValueError(f"calibration prompt of {n} tokens leaves {middle} positions between head_len={head_len} "
                     f"and tail_len={tail_len}; at least 2 * head_dim = {2 * head_dim} are needed")


# -- filling a context ---------------------------------------------------------------------


def _gaussian(key, mean, chol, batch: int, length: int, dtype):
  """[batch, length, H, D] draws of N(mean [H, D], chol chol^T)."""
  z = jax.random.normal(key, (batch, length, *mean.shape), jnp.float32)
  return (mean + jnp.einsum("BTHD,HED->BTHE", z, chol)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("policy", "cfg", "length"), donate_argnames=("state",))
def _fill_middle(
    state,
    key,
    layer,  # [] int32
    start,  # [] int32: first position of the chunk
    ends,  # [B] int32: each sequence's first tail position (the middle stops there)
    moments,  # (k_mean [Hkv, D], k_chol [Hkv, D, D], v_mean, v_chol, q_mean [Hq, D], q_chol [Hq, D, D])
    *,
    policy,
    cfg: ModelConfig,
    length: int,
):
  """Draws one chunk of middle positions of one layer and writes it into the prefill state."""
  k_mean, k_chol, v_mean, v_chol, q_mean, q_chol = moments
  B, dtype = ends.shape[0], jnp.dtype(cfg.dtype)
  pos = start + jnp.arange(length, dtype=jnp.int32)
  positions = jnp.where(pos[None, :] < ends[:, None], pos[None, :], _DROPPED)  # [B, T]
  kk, kv, kq = jax.random.split(key, 3)
  k = _gaussian(kk, k_mean, k_chol, B, length, dtype)
  v = _gaussian(kv, v_mean, v_chol, B, length, dtype)
  q = _gaussian(kq, q_mean, q_chol, B, length, dtype) if policy.reads_prompt_queries else None
  return policy.write_prompt(cfg, layer, q, k, v, positions, state)


@functools.partial(jax.jit, static_argnames=("policy", "cfg"), donate_argnames=("state",))
def _write_real(
    state,
    layer,  # [] int32
    q,  # [B, T, Hq, D] or None
    k,  # [B, T, Hkv, D]
    v,  # [B, T, Hkv, D]
    positions,  # [B, T] int32
    *,
    policy,
    cfg: ModelConfig,
):
  return policy.write_prompt(cfg, layer, q, k, v, positions, state)


@jax.jit
def _shift_rope(
    x,  # [B, T, H, D] after RoPE at their calibration positions
    shift,  # [B] int32: positions to move by
    inv_freq,  # [D // 2] float32
):
  """RoPE is a rotation per frequency, R(p + s) = R(s) R(p): rotating by `shift` alone moves a
  rotated vector to its new position exactly (up to rounding), whatever the scaling's factor."""
  positions = jnp.broadcast_to(shift[:, None], x.shape[:2])
  return apply_rope(x, positions, inv_freq, jnp.float32(1.0))


def _per_sequence(
    x,  # [H, T, D] one layer's real tokens
    *,
    batch: int,
):
  """The same tokens for every sequence: [batch, T, H, D]."""
  x = jnp.swapaxes(jnp.asarray(x), 0, 1)
  return jnp.broadcast_to(x[None], (batch, *x.shape))


def _available_host_bytes() -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def host_kv_bytes(policy, cfg: ModelConfig, lengths: Sequence[int]) -> int:
  """Bytes of keys and values a host-backed policy's store holds for these prompt lengths
  (indexes not counted); 0 for a device-only policy."""
  if not isinstance(policy, HostBackedMixin):
    return 0
  dense = set(policy.dense_layer_ids(cfg)) if hasattr(policy, "dense_layer_ids") else set()
  sparse_layers = cfg.num_layers - len(dense)
  codec = getattr(policy, "host_codec", "none")
  row_bytes = kv_codec.host_width(codec, cfg.head_dim) * kv_codec.wire_dtype(codec, cfg.dtype).itemsize
  return int(2 * sparse_layers * cfg.num_kv_heads * row_bytes * sum(lengths))


def synthetic_prefill(
    model,
    stats: KVStatistics,
    lengths: Sequence[int],
    *,
    max_new_tokens: int = 256,
    policy: str | Any = "full",
    policy_options: dict[str, Any] | None = None,
    seed: int = 0,
    chunk: int = 16384,
    on_fill_progress: Callable[[int, int], None] | None = None,
    on_index_progress: Callable[[int, int], None] | None = None,
) -> PrefilledContext:
  """A context of `lengths[b]` tokens per sequence, synthetic in the middle (module docstring).

  Args:
    model: the model `stats` was fitted with (same name, architecture hash and dtype), one device.
    stats: from `fit_statistics`.
    lengths: tokens per sequence; each at least stats.head_len + stats.tail_len.
    max_new_tokens: generation the context is sized for.
    policy: a policy that takes written prompts (full, retrieval, freekv) or its name; its sinks
      and window must lie within the statistics' real head and tail.
    policy_options: keyword options of the named policy.
    seed: the draws' seed; the same seed gives the same keys and values whatever the policy.
    chunk: middle positions drawn per step (bounds the draws' device memory).
    on_fill_progress: called with (layers written, layers total).
    on_index_progress: called with (layers offloaded and indexed, layers total) by host-backed
      policies.

  Returns:
    A PrefilledContext whose metadata["synthetic"] says what it is.
  """
  cfg = model.cfg
  theirs = (stats.model_name, stats.config_hash, stats.dtype)
  if theirs != (cfg.name, cfg.config_hash(), cfg.dtype):
    raise ValueError(f"stats were fitted with model {theirs} (name, config hash, dtype), not "
                     f"{(cfg.name, cfg.config_hash(), cfg.dtype)}")
  if getattr(model, "mesh", None) is not None:
    raise ValueError("synthetic contexts are built on one device; this model is sharded")
  if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic":
    raise ValueError("dynamic NTK scaling changes RoPE's frequencies with the context length, so the "
                     "calibration tail cannot be moved to another length; use linear, yarn or llama3 scaling")
  lengths = [checks.integer(n, f"lengths[{i}]", low=1) for i, n in enumerate(lengths)]  # 300.9 was read as 300
  need = stats.head_len + stats.tail_len
  if not lengths or min(lengths) < need:
    raise ValueError(f"lengths={lengths}: each must be >= head_len + tail_len = {need}")
  max_new_tokens = checks.integer(max_new_tokens, "max_new_tokens", low=1)
  chunk = checks.integer(chunk, "chunk", low=1)
  seed = checks.integer(seed, "seed")
  attention = make_policy(policy, **(policy_options or {}))
  if not attention.takes_written_prompt:
    raise ValueError(f"policy {attention.name!r} cannot be filled with a synthetic context "
                     "(full, retrieval and freekv can)")
  sinks, window = getattr(attention, "sinks", 0), getattr(attention, "window", 0)
  if sinks > stats.head_len or window > stats.tail_len:  # the device would attend Gaussian draws as sinks / window
    raise ValueError(f"policy {attention.name!r} keeps sinks={sinks} and window={window} on the device, but the "
                     f"statistics hold {stats.head_len} real head and {stats.tail_len} real tail tokens: fit them "
                     "with head_len >= sinks and tail_len >= window")
  check_context(cfg, max(lengths), max_new_tokens)
  needed, available = host_kv_bytes(attention, cfg, lengths), _available_host_bytes()
  if available is not None and needed > 0.9 * available:
    raise ValueError(f"the host store would hold {needed / 2**30:.1f} GiB of keys and values for lengths "
                     f"{lengths}, more than 90% of the {available / 2**30:.1f} GiB of host memory available")

  batch, longest = len(lengths), max(lengths)
  capacity = round_capacity(longest + max_new_tokens, attention)
  inv_freq = jnp.asarray(rope_tables(cfg, capacity)[0])  # [L, D // 2]
  head, tail = stats.head_len, stats.tail_len
  ends = np.asarray(lengths, np.int32) - tail  # [B]: first tail position of each sequence
  shift = jnp.asarray(ends - (stats.calibration_len - tail), jnp.int32)
  head_pos = jnp.broadcast_to(jnp.arange(head, dtype=jnp.int32), (batch, head))
  tail_pos = jnp.asarray(ends[:, None] + np.arange(tail, dtype=np.int32)[None])  # [B, tail]
  with_q = attention.reads_prompt_queries
  tiled = functools.partial(_per_sequence, batch=batch)
  # Fixed-size chunks (one compile); positions past a sequence's middle are dropped. The
  # query draws, the largest, are kept near 512 MiB.
  length = min(chunk, int(ends.max()) - head, max(256, 2**27 // (batch * cfg.num_heads * cfg.head_dim)))
  key = jax.random.key(seed)

  start_time = time.perf_counter()
  # Host-backed policies stage the fill: one sparse layer on the device at a time, offloaded
  # before the next is drawn (a dense prefill cache of every layer is 64 GiB for 8B shapes at
  # 4 x 128K); `full` keeps every layer on the device anyway.
  staged = attention.stages_prefill
  state = attention.prefill_state(cfg, batch, capacity, jnp.dtype(cfg.dtype), staged=True)
  release = attention.release_fn(state)  # taken before the state is donated
  try:
    state = attention.begin_prefill(cfg, state, np.asarray(lengths, np.int32))
    ends_device = jnp.asarray(ends)
    for layer in range(cfg.num_layers):
      layer_id = jnp.int32(layer)
      moments = tuple(jnp.asarray(getattr(stats, f"{name}_{part}")[layer])
                      for name in ("k", "v", "q") for part in ("mean", "chol"))
      layer_key = jax.random.fold_in(key, layer)
      for start in range(head, int(ends.max()), max(1, length)):
        state = _fill_middle(state, jax.random.fold_in(layer_key, start), layer_id, jnp.int32(start), ends_device,
                             moments, policy=attention, cfg=cfg, length=length)
      real_q = lambda x: tiled(x[layer]) if with_q else None
      if head:
        state = _write_real(state, layer_id, real_q(stats.head_q), tiled(stats.head_k[layer]),
                            tiled(stats.head_v[layer]), head_pos, policy=attention, cfg=cfg)
      moved = lambda x: _shift_rope(tiled(x[layer]), shift, inv_freq[layer])
      state = _write_real(state, layer_id, moved(stats.tail_q) if with_q else None, moved(stats.tail_k),
                          tiled(stats.tail_v[layer]), tail_pos, policy=attention, cfg=cfg)
      if on_fill_progress is not None:
        on_fill_progress(layer + 1, cfg.num_layers)
      if staged:
        state = attention.offload_layer(cfg, state, layer)
        if on_index_progress is not None:
          on_index_progress(layer + 1, cfg.num_layers)
    state = attention.finish_prefill(cfg, state, on_progress=on_index_progress)
    last_hidden = jnp.broadcast_to(jnp.asarray(stats.last_hidden), (batch, cfg.hidden_size)).astype(cfg.dtype)
    jax.block_until_ready(last_hidden)
  except BaseException:
    release()
    raise
  return PrefilledContext(
      model_name=cfg.name, config_hash=cfg.config_hash(), dtype=cfg.dtype, policy=attention, state=state,
      prompt_lengths=lengths, capacity=capacity, last_hidden=last_hidden,
      prefill_seconds=time.perf_counter() - start_time,
      metadata={"synthetic": stats.describe() + f", seed {seed}"}, weights=weights_fingerprint(model.params),
      _release=release)
