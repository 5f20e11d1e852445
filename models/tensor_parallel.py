"""Tensor-parallel layout of the decoder's weights over a 1-D device mesh of attention heads.

Megatron-style, one mesh axis (`HEADS`, "heads"); N devices, each owning Hkv/N KV heads and the
Hq/N query heads that read them (query head h reads KV head h // G, so consecutive blocks of
heads stay together):

    wq, wk, wv  [hidden, heads*D]   column-sharded: device i computes its own heads' q, k, v
    bq, bk, bv  [heads*D]           sharded like their columns
    wo          [Hq*D, hidden]      row-sharded: device i's rows give a partial sum -> psum
    w_gate/w_up [hidden, I]         column-sharded (each device an I/N slice of the MLP)
    w_down      [I, hidden]         row-sharded: a partial sum -> psum
    norms, embed, final_norm        replicated
    lm_head     [hidden, vocab]     vocab-sharded when N divides vocab (used outside shard_map,
                                    where XLA gathers the logits), else replicated

The MLP is sharded rather than replicated: it holds about two thirds of a Llama layer's
weights, and decode is bound by reading weights, so a replicated MLP would leave each device
reading most of the model. It costs a second all-reduce of [B, T, hidden] per layer.

Fused weights (`models.decoder.decode_layout`): `wqkv` [hidden, (Hq + 2 Hkv) D] has columns
[q | k | v] and `w_gate_up` [hidden, 2 I] has [gate | up]; a plain column split would give
device 0 all of q. `shard_major` reorders their columns to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
(resp. [gate_0 up_0 | gate_1 up_1 | ...]), so each device's column block is its own fused
[q_i | k_i | v_i] and the decoder splits it with the per-device head counts. The reordered
weights are only meaningful to the sharded program (kvjax.sharding).

Every layer leaf may carry a leading [num_layers] axis (stacked) or not (unrolled list).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from models.config import ModelConfig

HEADS = "heads"

# Per-layer weights: which axis (counted from the end) is split over the mesh; absent = replicated.
_COLUMN = -1
_ROW = -2
_LAYER_AXIS = {"wq": _COLUMN, "wk": _COLUMN, "wv": _COLUMN, "bq": _COLUMN, "bk": _COLUMN, "bv": _COLUMN,
               "wqkv": _COLUMN, "bqkv": _COLUMN, "wo": _ROW,
               "w_gate": _COLUMN, "w_up": _COLUMN, "w_gate_up": _COLUMN, "w_down": _ROW}


def check_shardable(cfg: ModelConfig, devices: int) -> None:
  """Raises ValueError unless `devices` devices can each own whole KV heads and an MLP slice."""
  if devices < 1:
    raise ValueError(f"{devices=} must be >= 1")
  if cfg.num_kv_heads % devices:
    raise ValueError(
        f"{devices} devices do not divide the {cfg.num_kv_heads} KV heads of {cfg.name} (num_kv_heads="
        f"{cfg.num_kv_heads}, num_heads={cfg.num_heads}): each device attends whole KV heads and their query "
        f"heads; use a device count that divides {cfg.num_kv_heads}")
  if cfg.intermediate_size % devices:
    raise ValueError(f"{devices} devices do not divide intermediate_size={cfg.intermediate_size} of {cfg.name} "
                     "(the MLP is column/row-sharded)")


def local_config(cfg: ModelConfig, devices: int) -> ModelConfig:
  """The config one device sees inside shard_map: its share of the heads and of the MLP."""
  check_shardable(cfg, devices)
  return dataclasses.replace(cfg, num_heads=cfg.num_heads // devices, num_kv_heads=cfg.num_kv_heads // devices,
                             intermediate_size=cfg.intermediate_size // devices)


def shard_major(
    w,  # [..., sum(widths)]: column blocks of `widths` concatenated
    widths: tuple[int, ...],
    devices: int,
):
  """Reorders the columns of concatenated blocks so each device's slice of every block is adjacent:
  [a | b] -> [a_0 b_0 | a_1 b_1 | ...]. Each width must be divisible by `devices`."""
  assert sum(widths) == w.shape[-1], (widths, w.shape)
  blocks, start = [], 0
  for width in widths:
    assert width % devices == 0, (width, devices)
    blocks.append(w[..., start : start + width].reshape(w.shape[:-1] + (devices, width // devices)))
    start += width
  return jnp.concatenate(blocks, axis=-1).reshape(w.shape)  # [..., devices, sum(widths) / devices]


def _fused_widths(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
  D = cfg.head_dim
  if name in ("wqkv", "bqkv"):
    return (cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D)
  if name == "w_gate_up":
    return (cfg.intermediate_size, cfg.intermediate_size)
  return None


def _layer_spec(name: str, ndim: int) -> P:
  axis = _LAYER_AXIS.get(name)
  if axis is None:
    return P()
  spec = [None] * ndim
  spec[ndim + axis] = HEADS
  return P(*spec)


def _map_layers(fn, layers):
  """fn(name, leaf) over a stacked layer dict or an unrolled list of them."""
  if isinstance(layers, (list, tuple)):
    return [{k: fn(k, w) for k, w in lp.items()} for lp in layers]
  return {k: fn(k, w) for k, w in layers.items()}


def partition_specs(params, cfg: ModelConfig, devices: int) -> dict:
  """The PartitionSpec of every leaf of `params` (same tree), for `devices` devices."""
  specs = {"layers": _map_layers(lambda name, w: _layer_spec(name, w.ndim), params["layers"])}
  for name, w in params.items():
    if name == "lm_head":
      specs[name] = P(None, HEADS) if cfg.vocab_size % devices == 0 else P()
    elif name != "layers":
      specs[name] = P()
  return specs


def shard_params(params, cfg: ModelConfig, mesh: jax.sharding.Mesh):
  """`params` reordered (fused columns, `shard_major`) and placed over `mesh` by `partition_specs`.

  The result is for the sharded program only: fused weights are in shard-major column order.
  """
  devices = mesh.shape[HEADS]
  check_shardable(cfg, devices)

  def reorder(name, w):
    widths = _fused_widths(cfg, name)
    return shard_major(w, widths, devices) if widths is not None else w

  params = dict(params, layers=_map_layers(reorder, params["layers"]))
  specs = partition_specs(params, cfg, devices)
  return jax.tree.map(lambda w, spec: jax.device_put(w, NamedSharding(mesh, spec)), params, specs,
                      is_leaf=lambda x: isinstance(x, P))
