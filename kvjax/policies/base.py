"""The interface every attention policy implements.

A policy is a frozen (hashable) dataclass, so it is a static argument of the jitted prefill
and decode functions. Its state is a registered pytree holding all layers; the decoder hands
the whole state to `attend` together with the traced layer index (see models.decoder).

State convention, which kvjax.sharding relies on to split a state over devices by KV head:
every array of rank >= 3 is [layers, batch, heads, ...] (KV or query heads; query heads come in
GQA groups, so a device's KV heads and its query heads are the same fraction); smaller arrays
are per-sequence or per-layer and identical on every device, except the host-backed policies'
`runtime_id` and `status`, which name and report each device's own host runtime.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import device_read
from models.config import ModelConfig
from models.decoder import forward_hidden


class AttentionPolicy(abc.ABC):
  """Base class of attention policies (full, streaming, quest, retrieval, freekv)."""

  name: str = "abstract"
  # Options that may differ between prefill and decode of a saved context (they do not
  # shape the state); a plain class attribute, not a dataclass field.
  decode_options = ("implementation",)
  # Whether `write_prompt` is implemented (kvjax.synthetic fills contexts through it), and
  # whether it reads the queries (the synthetic filler draws them only then).
  takes_written_prompt = False
  reads_prompt_queries = False
  stages_prefill = False  # see HostBackedMixin
  # The cache capacity generate chooses is a multiple of this (quest: its page size).
  capacity_multiple = 1

  def decode_option_values(self) -> dict[str, Any]:
    """Every decode option's value, defaults included: what a copied or loaded context must be
    given so that it decodes as this policy (unset options would keep the saving policy's)."""
    return {k: getattr(self, k) for k in self.decode_options}

  @abc.abstractmethod
  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> Any:
    """Empty state for `batch` sequences of up to `capacity` tokens (prompt + generation)."""

  @abc.abstractmethod
  def attend(
      self,
      cfg: ModelConfig,
      layer,  # [] int32, traced
      q,  # [batch, seq, num_heads, head_dim] after RoPE, unscaled
      k,  # [batch, seq, num_kv_heads, head_dim] after RoPE
      v,  # [batch, seq, num_kv_heads, head_dim]
      positions,  # [batch, seq] int32
      state: Any,
  ) -> tuple[jax.Array, Any]:
    """Writes the new keys/values into the state and attends; returns ([B, T, Hq, D], state)."""

  def describe(self) -> str:
    return self.name

  def prefill_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype, *, staged: bool) -> Any:
    """init_state for a prefill, staged (one sparse layer's prompt on the device at a time,
    see HostBackedMixin) where asked and the policy can; plain otherwise."""
    if staged and self.stages_prefill:
      return self.init_state(cfg, batch, capacity, dtype, staged=True)
    return self.init_state(cfg, batch, capacity, dtype)

  def write_prompt(
      self,
      cfg: ModelConfig,
      layer,  # [] int32, traced
      q,  # [batch, seq, num_heads, head_dim] after RoPE, or None unless reads_prompt_queries
      k,  # [batch, seq, num_kv_heads, head_dim] after RoPE
      v,  # [batch, seq, num_kv_heads, head_dim]
      positions,  # [batch, seq] int32; out-of-range positions (>= capacity) are dropped
      state: Any,
  ) -> Any:
    """Stores prompt tokens in the prefill state without attending, as a prefill chunk would
    (kvjax.synthetic builds contexts this way); `finish_prefill` follows as after a prefill."""
    raise ValueError(f"policy {self.name!r} cannot take a written (synthetic) prompt")

  def forward_hidden(
      self,
      params,
      tokens,  # [batch, seq] int32
      positions,  # [batch, seq] int32
      *,
      cfg: ModelConfig,
      rope: tuple,
      state: Any,
  ):
    """The decoder pass with this policy's attention: (hidden [batch, seq, hidden], state).

    kvjax.sharding.ShardedPolicy overrides it to run the pass under shard_map."""
    hidden, state = forward_hidden(params, tokens, positions, cfg=cfg, rope=rope,
                                   attention_fn=functools.partial(self.attend, cfg), attention_state=state)
    return hidden, self.after_layers(cfg, positions, state)

  def after_layers(
      self,
      cfg: ModelConfig,
      positions,  # [batch, seq] int32: the pass's positions
      state: Any,
  ) -> Any:
    """In-jit work after every layer of a pass has attended: bookkeeping that no layer's
    output needs, done once for all layers instead of in each (fewer kernels per step)."""
    return state

  # Lifecycle hooks, run outside jit by generate(); the defaults suit device-only policies.

  def begin_prefill(self, cfg: ModelConfig, state: Any, prompt_lengths) -> Any:
    """Called once before the first prefill chunk with the prompts' lengths [batch]."""
    return state

  def finish_prefill(self, cfg: ModelConfig, state: Any, on_progress=None) -> Any:
    """Turns the prefill state into the decode state (e.g. offload and index the prompt)."""
    return state

  def check(self, state: Any) -> None:
    """Raises any error the host side recorded during the last step."""

  def start_after_step(self, state: Any, tokens: Any = None) -> Any:
    """Runs right after a decode step is dispatched, outside jit, before its token is awaited:
    starts what `after_step` will read from the step's outputs (`state`), so that the copy runs
    as soon as the step ends instead of in the device-idle time after it (e.g. retrieval's
    per_step bridge, kvjax.device_read.start_reading). tokens: the step's sampled tokens [batch]
    (a device array), to read in the same copy. Returns what to pass to `after_step` as
    `started`, a kvjax.device_read.PendingRead whose `also()` gives `tokens` when they were given;
    None when there is nothing to start."""
    return None

  def after_step(self, cfg: ModelConfig, state: Any, started: Any = None) -> Any:
    """Runs between decode steps, outside jit: checks the step and returns the state for the
    next one (a policy may do host work here, e.g. retrieval's per_step bridge). started: what
    `start_after_step(state)` returned, or None (the policy then reads what it needs itself)."""
    self.check(state)
    return state

  # A policy that runs each decode step twice: the first pass (its input state kept) gives the
  # step's queries, `repeat_step` prepares the second from them (e.g. retrieval per_step lag 0).
  repeats_steps = False

  def repeat_step(self, cfg: ModelConfig, before: Any, after: Any) -> Any | None:
    """Between a step's two passes, outside jit (only with `repeats_steps`): the state to run the
    step again from, given the state it started from and the first pass's result; None keeps
    the first pass."""
    return None

  def host_context(self, state: Any):
    """The host_index.HostContext behind `state`, None for device-only policies."""
    return None

  def attach_host(self, cfg: ModelConfig, state: Any, context) -> Any:
    """Binds a loaded host context to a loaded state (see HostBackedMixin)."""
    raise ValueError(f"policy {self.name!r} keeps nothing on the host")

  def stats(self, state: Any) -> dict:
    """Counters of the run so far (host time, correction and hit rates...); {} if none."""
    return {}

  def merge_device_stats(self, per_device: list[dict]) -> dict:
    """One `stats` dict for a decode sharded over devices (kvjax.sharding), from each device's:
    numbers summed (each device counts, stores and times its own heads; its host hooks run
    one after another), other values kept where the devices agree. Policies whose stats hold
    rates, per-step figures or maxima override it."""
    merged = {}
    for key in per_device[0]:
      values = [d[key] for d in per_device]
      if all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values):
        merged[key] = sum(values)
      else:
        merged[key] = values[0] if all(v == values[0] for v in values) else values
    return merged

  def release_fn(self, state: Any):
    """A callable that frees the host resources of `state`; taken before the state is
    donated to a jitted step (donation invalidates its arrays)."""
    return lambda: None


def merged_counters(cls, per_device: list[dict], prefix: str = "", maxima: tuple[str, ...] = (),
                    shared: tuple[str, ...] = ()):
  """A counters dataclass `cls` whose fields are read from each device's stats dict (as
  `prefix + field`) and summed: `maxima` take the largest, `shared` (the same on every device,
  as a page's size) the first device's."""
  def merge(name):
    values = [d[prefix + name] for d in per_device]
    return max(values) if name in maxima else values[0] if name in shared else sum(values)

  return cls(**{f.name: merge(f.name) for f in dataclasses.fields(cls)})


class DenseLayersMixin:
  """For policies with a `dense_layers` field: which layers attend densely on the device.

  Sliding-window layers (Gemma 3's local layers) are always dense: they attend to at most
  their own window, so offloading them gains nothing.
  """

  dense_layers: tuple[int, ...]

  def dense_layer_ids(self, cfg: ModelConfig) -> tuple[int, ...]:
    bad = [l for l in self.dense_layers if not 0 <= l < cfg.num_layers]
    if bad:
      raise ValueError(f"dense_layers {bad} out of range for {cfg.num_layers} layers")
    local = [l for l, w in enumerate(cfg.layer_windows) if w > 0]
    return tuple(sorted(set(self.dense_layers) | set(local)))

  def prefill_slots(self, cfg: ModelConfig, staged: bool) -> np.ndarray:
    """[L] int32: the dense prefill cache's slot of each layer. Unstaged, the cache holds every
    layer; staged, it holds the dense layers (slots 0 .. n_dense - 1) and one staging slot
    (n_dense) that each sparse layer uses in turn, offloaded before the next is written."""
    if not staged:
      return np.arange(cfg.num_layers, dtype=np.int32)
    dense = self.dense_layer_ids(cfg)
    table = np.full(cfg.num_layers, len(dense), np.int32)
    table[list(dense)] = np.arange(len(dense), dtype=np.int32)
    return table

  def dense_slot(self, cfg: ModelConfig, layer):
    """Index of `layer` (traced int32) in the decode-time dense cache, -1 for a sparse layer."""
    table = np.full(cfg.num_layers, -1, np.int32)
    for i, l in enumerate(self.dense_layer_ids(cfg)):
      table[l] = i
    return jnp.asarray(table)[layer]

  def dense_or_sparse(self, cfg: ModelConfig, layer, dense_fn, sparse_fn, state):
    """dense_fn(slot, state) on a dense layer (slot: its index in the dense cache), else
    sparse_fn(state). A Python int layer (unrolled layers, as on a GPU) picks the branch while
    tracing (no lax.cond carrying the whole policy state through both branches, which XLA may
    copy); a traced layer (lax.scan) needs the cond."""
    dense = self.dense_layer_ids(cfg)
    if not dense:
      return sparse_fn(state)
    if isinstance(layer, (int, np.integer)):
      return dense_fn(dense.index(layer), state) if layer in dense else sparse_fn(state)
    slot = self.dense_slot(cfg, layer)
    return jax.lax.cond(slot >= 0, lambda st: dense_fn(slot, st), sparse_fn, state)


class HostBackedMixin:
  """For policies whose state names a host runtime (kvjax.host_runtime) by its id.

  Subclasses implement `new_runtime(cfg, context)`: wrap a host_index.HostContext in a
  registered runtime configured by the policy's options. `attach_host` uses it when a saved
  context is loaded, so decode-time options (top-k, speculation, tau) may differ from the
  ones the context was prefilled with.
  """

  def new_runtime(self, cfg: ModelConfig, context):
    raise NotImplementedError

  def runtime(self, state):
    from kvjax import host_runtime

    return host_runtime.lookup(int(state.runtime_id))

  def check(self, state) -> None:
    self.checked_runtime(*device_read.read_together((state.runtime_id, state.status)))  # one copy for both

  def checked_runtime(self, runtime_id, status):
    """The runtime `runtime_id` names, once any error its host side or the step's callbacks
    recorded (`status`) is raised. Both are host values read from a state: each read of a device
    scalar is a synchronous copy, and the per_step bridges read them with the step's rows."""
    from kvjax import host_runtime

    runtime = host_runtime.lookup(int(runtime_id))
    if runtime is None:
      raise RuntimeError(f"host runtime {int(runtime_id)} is gone (released or never created)")
    runtime.raise_errors()
    if int(status) != host_runtime.STATUS_OK:
      raise RuntimeError(f"{self.name} host callback returned status {int(status)}")
    return runtime

  def release_fn(self, state):
    runtime = self.runtime(state)
    return runtime.close if runtime is not None else (lambda: None)

  def host_context(self, state):
    runtime = self.runtime(state)
    return None if runtime is None else runtime.context

  def attach_host(self, cfg: ModelConfig, state, context):
    runtime = self.new_runtime(cfg, context)
    try:
      return self.prepare_attached(cfg, state.replace(runtime_id=jnp.int32(runtime.id), status=jnp.int32(0)))
    except BaseException:
      runtime.close()  # a failed load or copy leaves no runtime (nor its host memory) registered
      raise

  def prepare_attached(self, cfg: ModelConfig, state):
    """What a loaded or copied state needs once its new runtime exists (default: nothing)."""
    return state

  # Host-backed policies can stage their prefill (`init_state(..., staged=True)`): the device
  # holds one sparse layer's prompt at a time and `offload_layer` moves it to the host before
  # the next is written (kvjax.synthetic fills contexts this way).
  stages_prefill = True

  def reserve_decode_room(self, cfg: ModelConfig, context, capacity: int) -> None:
    """Sizes every host-resident (seq, layer) store and its indexes for all the tokens decode can
    evict (the host holds positions from `sinks` on, the device the last `window`), so no decode
    step pays an amortized growth: a copy of the whole layer, ~130 MB for 8B shapes at 32K, that
    cost 30-50 ms per step on average in bench_decode before this; and of every index's node
    arrays, which made the first step of a 128K SmolLM2-shape decode ~700 ms, a reloaded
    context's too (bench_scale_smollm2shapes_synthetic_128k_roar_kv_parts.md). A fresh build
    sizes them from the reserved store; a load restores them at their saved size, and this
    grows them at load time instead."""
    room = max(0, capacity - self.sinks - self.window)
    dense = set(self.dense_layer_ids(cfg)) if hasattr(self, "dense_layer_ids") else set()
    for layer in range(cfg.num_layers):
      if layer not in dense:
        for seq in range(context.num_seqs):
          context.reserve(seq, layer, room)


@functools.partial(jax.jit, donate_argnums=(0,))
def set_layer(
    stacked,  # [L, ...]
    layer,  # [] int32
    value,  # [...]
):
  """stacked[layer] = value, in place (the stacked array is donated)."""
  return stacked.at[layer].set(value.astype(stacked.dtype))


def layer_window(cfg: ModelConfig, layer):
  """Sliding window of `layer` (traced int32), 0 for a global layer."""
  return jnp.asarray(cfg.layer_windows, dtype=jnp.int32)[layer]
