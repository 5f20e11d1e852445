"""Decoding over several devices of one host: KV heads sharded over a 1-D mesh ("heads").

    model = kvjax.load_model("random:llama3-8b", dtype="bfloat16", devices=4)
    kvjax.generate(model, prompt_ids, policy="full")     # every policy; devices=1 = the plain path

What is sharded how (models.tensor_parallel has the weights):

  * weights: q/k/v projections by columns (own heads), `wo` and `w_down` by rows, gate/up by
    columns; embedding and norms replicated; an untied `lm_head` by vocabulary.
  * the policy state: every array of rank >= 3 is [layers, batch, heads, ...] by convention of
    the policies (KV caches, rings, pools, page summaries, kept queries), split on axis 2;
    smaller arrays (prompt lengths, per-layer flags) are replicated; a host-backed policy's
    `runtime_id` and `status` become [N] int32, one per device.
  * the host side: one host runtime (host_index.HostContext holding Hkv/N heads, its threads,
    counters) per device, made by running the policy's `init_state` once per device with the
    per-device config; each device's `pure_callback` finds its own runtime by the id in its
    slice of `runtime_id`, so a retrieval layer still makes one callback per step per device.

The decoder runs inside one `jax.shard_map` over the mesh (`ShardedPolicy.forward_hidden`):
every device runs the plain decoder and policy code with its share of the heads
(`models.tensor_parallel.local_config`), the Pallas kernels and host callbacks included, which
XLA would not partition on its own. Attention needs no communication: a device attends its own
heads, and the device/host LSE merge is per head. The only collectives are two all-reduces
(`lax.psum`) of [batch, seq, hidden] per layer, after `wo` and after `w_down`; the logits,
computed outside the shard_map, gather the vocabulary-sharded `lm_head` output when there is one.

The policy hooks that run outside jit (`begin_prefill`, `finish_prefill`, `check`, `stats`,
release) run on each device's slice of the state in turn (`split_state` / `join_state`) with the
per-device config; `stats` merges the devices' counters as the policy says (`merge_device_stats`:
counts, bytes and host seconds summed, rates and per-step figures computed again from the sums),
with the per-device dicts under "devices".

`after_step` runs the same way, so retrieval's bridge="per_step" works per device too: each
device's runtime stores, searches and gathers for its own heads between steps.

A sharded context saves and loads (kvjax.context_cache: one state and host file per device) onto
a model sharded over the same device count; decode refuses a context prefilled on other devices.

Not done: running the per-device hooks (index builds, per_step host work) in parallel; a
vocabulary-sharded embedding lookup; meshes across hosts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.policies.base import AttentionPolicy
from models.config import ModelConfig
from models.decoder import forward_hidden
from models.tensor_parallel import HEADS, check_shardable, local_config, partition_specs, shard_params

HEAD_AXIS = 2  # [layers, batch, heads, ...]: the policies' state convention
PER_DEVICE_FIELDS = ("runtime_id", "status")  # scalars of a host-backed policy, one per device


def check_devices(devices):
  """`devices` as a positive int or a list of distinct jax.Device; TypeError / ValueError naming it."""
  if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
    if devices < 1:
      raise ValueError(f"devices={devices}; expected a count >= 1")
    return int(devices)
  if not isinstance(devices, (list, tuple)) or not all(isinstance(d, jax.Device) for d in devices):
    raise TypeError(f"devices={devices!r}; expected a count or a list of jax.Device")
  if not devices or len(set(devices)) != len(devices):
    raise ValueError(f"devices={list(devices)}; expected distinct devices, at least one")
  return list(devices)


def head_mesh(devices: int | list) -> Mesh:
  """A 1-D mesh named "heads" over the first `devices` local devices (or the given devices)."""
  if isinstance(devices, int):
    available = jax.local_devices()
    if not 1 <= devices <= len(available):
      raise ValueError(f"devices={devices} but this process sees {len(available)} "
                       f"{jax.default_backend()} device(s)")
    devices = available[:devices]
  return Mesh(np.asarray(devices), (HEADS,))


def replicated(x, mesh: Mesh):
  """`x` copied to every device of `mesh` (as the sharded programs return replicated values)."""
  return jax.device_put(x, NamedSharding(mesh, P()))


@dataclasses.dataclass(frozen=True)
class ShardedModel:
  """A model whose weights are spread over `mesh` (models.tensor_parallel); duck-types LoadedModel."""

  cfg: ModelConfig
  params: Any
  tokenizer: Any
  mesh: Mesh
  source: str = ""


def shard_model(model, devices: int | list):
  """`model` (anything with cfg, params, tokenizer) with its weights sharded over `devices`.

  devices: a count (the first local devices) or a list of distinct jax.Device. One device
  returns `model` unchanged: the unsharded path (a single listed device must be the default
  one: the model stays where it was loaded). Raises ValueError when the device count does not
  divide the KV heads (or the MLP width), naming both.
  """
  devices = check_devices(devices)
  count = devices if isinstance(devices, int) else len(devices)
  check_shardable(model.cfg, count)
  if count == 1:
    if not isinstance(devices, int) and devices[0] != jax.devices()[0]:
      raise ValueError(f"devices={devices}: one device other than the default {jax.devices()[0]}; "
                       "load the model there (jax.default_device) instead")
    return model
  mesh = head_mesh(devices)
  params = shard_params(model.params, model.cfg, mesh)
  source = f"{getattr(model, 'source', '')}, heads sharded over {count} devices"
  return ShardedModel(cfg=model.cfg, params=params, tokenizer=model.tokenizer, mesh=mesh, source=source)


# -- the policy state over the mesh ----------------------------------------------------------


def _field(path) -> str:
  last = path[-1] if path else None
  return getattr(last, "name", getattr(last, "key", ""))


def _leaf_kind(path, leaf):
  """HEAD_AXIS, "device" (one scalar per device) or None (replicated)."""
  if _field(path) in PER_DEVICE_FIELDS and np.ndim(leaf) <= 1:
    return "device"
  return HEAD_AXIS if np.ndim(leaf) >= 3 else None


def _local_shape(path, leaf, devices: int) -> tuple:
  """The shape of one device's slice of a global state leaf."""
  kind = _leaf_kind(path, leaf)
  if kind == "device":
    return (1,)
  if kind == HEAD_AXIS:
    return leaf.shape[:HEAD_AXIS] + (leaf.shape[HEAD_AXIS] // devices,) + leaf.shape[HEAD_AXIS + 1:]
  return leaf.shape


def state_specs(state):
  """PartitionSpec per leaf of a (global) policy state."""
  def spec(path, leaf):
    kind = _leaf_kind(path, leaf)
    if kind == "device":
      return P(HEADS)
    return P(*([None] * HEAD_AXIS + [HEADS])) if kind == HEAD_AXIS else P()
  return jax.tree_util.tree_map_with_path(spec, state)


def _squeeze_device_fields(state):  # inside shard_map: [1] -> [] for the policy's code
  return jax.tree_util.tree_map_with_path(lambda p, x: x[0] if _leaf_kind(p, x) == "device" else x, state)


def _expand_device_fields(state):  # [] -> [1], the device's slice of the global [N]
  return jax.tree_util.tree_map_with_path(lambda p, x: x[None] if _field(p) in PER_DEVICE_FIELDS and x.ndim == 0
                                          else x, state)


def split_state(state, mesh: Mesh) -> list:
  """The global state as one per-device state (its own heads; per-device scalars as [])."""
  devices = list(mesh.devices.flat)

  def pieces(path, leaf):
    by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
    out = [by_device[d] for d in devices]
    return [x.reshape(()) for x in out] if _leaf_kind(path, leaf) == "device" else out

  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  per_leaf = [pieces(path, leaf) for path, leaf in flat]
  return [jax.tree_util.tree_unflatten(treedef, [p[i] for p in per_leaf]) for i in range(len(devices))]


def join_state(states: list, mesh: Mesh):
  """Per-device states (as `split_state` gives, possibly reshaped by a hook) -> one global state."""
  devices = list(mesh.devices.flat)
  n = len(devices)
  flats = [jax.tree_util.tree_flatten_with_path(s) for s in states]
  treedef = flats[0][1]
  assert all(f[1] == treedef for f in flats), "per-device states differ in structure"
  leaves = []
  for j, (path, first) in enumerate(flats[0][0]):
    local = [jax.device_put(f[0][j][1], d) for f, d in zip(flats, devices)]
    kind = _leaf_kind(path, first)
    if kind == "device":
      local = [x.reshape((1,)) for x in local]
      shape, spec = (n,), P(HEADS)
    elif kind == HEAD_AXIS:
      shape = first.shape[:HEAD_AXIS] + (first.shape[HEAD_AXIS] * n,) + first.shape[HEAD_AXIS + 1:]
      spec = P(*([None] * HEAD_AXIS + [HEADS]))
    else:
      shape, spec = first.shape, P()
    leaves.append(jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, spec), local))
  return jax.tree_util.tree_unflatten(treedef, leaves)


# -- the policy wrapper ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardedPolicy(AttentionPolicy):
  """`inner` run on each device of `mesh` with its share of the heads; see the module docstring.

  generate.prefill wraps the policy in one when the model has a mesh (`shard_model`); the
  engine calls `forward_hidden`, which runs the whole decoder under shard_map.
  """

  inner: AttentionPolicy
  mesh: Mesh
  name: str = "sharded"

  @property
  def devices(self) -> int:
    return self.mesh.shape[HEADS]

  @property
  def capacity_multiple(self) -> int:
    return self.inner.capacity_multiple

  def local_cfg(self, cfg: ModelConfig) -> ModelConfig:
    return local_config(cfg, self.devices)

  def describe(self) -> str:
    return f"{self.inner.describe()} over {self.devices} devices"

  # -- the program -------------------------------------------------------------------------

  def forward_hidden(self, params, tokens, positions, *, cfg: ModelConfig, rope, state):
    """models.decoder.forward_hidden under shard_map: hidden [B, T, hidden] replicated, state sharded."""
    local = self.local_cfg(cfg)
    body_params = {k: v for k, v in params.items() if k != "lm_head"}  # logits are computed outside
    param_specs = partition_specs(body_params, cfg, self.devices)
    # Empty leaves (a policy's [0, ...] arrays, e.g. no dense layers) stay outside shard_map: on
    # the CPU backend of jax 0.11.2 a zero-size sharded operand of shard_map crashes the process.
    # The body makes their per-device (equally empty) versions itself.
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    empty = [leaf.size == 0 for _, leaf in flat]
    local_empty = [jax.ShapeDtypeStruct(_local_shape(path, leaf, self.devices), leaf.dtype) if e else None
                   for (path, leaf), e in zip(flat, empty)]
    live = [leaf for (_, leaf), e in zip(flat, empty) if not e]
    specs = jax.tree.leaves(state_specs(state), is_leaf=lambda x: isinstance(x, P))
    assert len(specs) == len(flat), (len(specs), len(flat))
    live_specs = [spec for spec, e in zip(specs, empty) if not e]

    def body(params, tokens, positions, rope, live):
      it = iter(live)
      leaves = [jnp.zeros(le.shape, le.dtype) if le is not None else next(it) for le in local_empty]
      state = _squeeze_device_fields(jax.tree_util.tree_unflatten(treedef, leaves))
      hidden, state = forward_hidden(
          params, tokens, positions, cfg=local, rope=rope, attention_fn=functools.partial(self.inner.attend, local),
          attention_state=state, partial_sum=lambda y: jax.lax.psum(y, HEADS))
      state = self.inner.after_layers(local, positions, state)
      out = jax.tree_util.tree_leaves(_expand_device_fields(state))
      return hidden, [leaf for leaf, e in zip(out, empty) if not e]

    # check_vma=False: the ops' loops start their carries from constants (not "varying" over the
    # mesh) and Pallas calls carry no such types; the one replicated output, hidden, is
    # replicated by construction (the residual stream only ever adds psum results).
    mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(param_specs, P(), P(), P(), live_specs),
                           out_specs=(P(), live_specs), check_vma=False)
    hidden, live = mapped(body_params, tokens, positions, rope, live)
    it = iter(live)
    return hidden, jax.tree_util.tree_unflatten(treedef, [leaf if e else next(it)
                                                          for (_, leaf), e in zip(flat, empty)])

  def attend(self, cfg, layer, q, k, v, positions, state):
    raise TypeError("a ShardedPolicy runs whole decoder passes (forward_hidden), not single layers")

  # -- state and hooks, per device ---------------------------------------------------------

  def _per_device(self, fn, state):
    """[fn(device's state) for each device], each run with that device as the default."""
    out = []
    for device, local in zip(self.mesh.devices.flat, split_state(state, self.mesh)):
      with jax.default_device(device):
        out.append(fn(local))
    return out

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype):
    local = self.local_cfg(cfg)
    states = []
    try:
      for device in self.mesh.devices.flat:
        with jax.default_device(device):  # each device's share is made in place, never gathered
          states.append(self.inner.init_state(local, batch, capacity, dtype))
      return join_state(states, self.mesh)
    except BaseException:  # a later device failed (out of memory): nothing else holds the earlier runtimes
      for made in states:
        self.inner.release_fn(made)()
      raise

  def begin_prefill(self, cfg, state, prompt_lengths):
    local = self.local_cfg(cfg)
    return join_state(self._per_device(lambda s: self.inner.begin_prefill(local, s, prompt_lengths), state),
                      self.mesh)

  def finish_prefill(self, cfg, state, on_progress=None):
    local = self.local_cfg(cfg)
    return join_state(self._per_device(lambda s: self.inner.finish_prefill(local, s, on_progress=on_progress),
                                       state), self.mesh)

  def check(self, state) -> None:
    self._per_device(self.inner.check, state)

  def after_step(self, cfg, state, started=None):
    """The inner policy's between-step host work on each device's share (retrieval's per_step
    bridge: each device's runtime searches its own heads and updates its own row buffers). Each
    share reads its step's outputs here: start_after_step is the base's (nothing started), since
    the shares are split anew at each call."""
    del started  # always None (start_after_step is not overridden)
    local = self.local_cfg(cfg)
    return join_state(self._per_device(lambda s: self.inner.after_step(local, s), state), self.mesh)

  @property
  def repeats_steps(self) -> bool:
    return self.inner.repeats_steps

  def repeat_step(self, cfg, before, after):
    """The inner policy's repeat_step on each device's share (retrieval per_step lag 0: each
    device's runtime stores, searches and gathers its own heads); the state of the second pass,
    or None when no device's rows changed. A device whose rows did not change runs the second
    pass on its unchanged state, which gives its first pass's result again."""
    local = self.local_cfg(cfg)
    befores = split_state(before, self.mesh)  # split once: a device's repeat_step donates its own share
    again = []
    for device, b, a in zip(self.mesh.devices.flat, befores, split_state(after, self.mesh)):
      with jax.default_device(device):
        again.append(self.inner.repeat_step(local, b, a))
    if all(s is None for s in again):
      return None
    return join_state([b if s is None else s for s, b in zip(again, befores)], self.mesh)

  def stats(self, state) -> dict:
    """The inner policy's stats merged over the devices (its `merge_device_stats`: counters
    summed, rates and per-step figures computed again from the sums); per device under "devices"."""
    per_device = self._per_device(self.inner.stats, state)
    if not any(per_device):
      return {}
    return self.inner.merge_device_stats(per_device) | {"devices": per_device}

  def release_fn(self, state):
    releases = self._per_device(self.inner.release_fn, state)
    return lambda: [release() for release in releases]

  def host_context(self, state):
    return None  # one context per device: kvjax.context_cache saves each device's share itself
