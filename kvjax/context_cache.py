"""Saving, loading and copying prefilled contexts, so decode never waits for a second prefill.

A saved context is a directory, written under a temporary name, fsynced and renamed into place:

    manifest.json   format version, model identity (with a fingerprint of the weights), a
                    save id, policy and options, prompt lengths, capacity, the device count,
                    the state's structure with each leaf's shape, dtype and crc32, and the
                    crc32 of the manifest itself
    state/          the policy state's device arrays and the prompts' last hidden states (orbax)
    host.bin        the host store and indexes (host_index persistence, itself checksummed)

A context prefilled over N > 1 devices (kvjax.sharding) is saved as N per-device states (arrays
`dev{d}_leaf_{i}`, each holding that device's heads) and N host files `host_{d}.bin` (each
device's own store and indexes); it loads only onto a model sharded over N devices, each device
getting back its own share.

Loading checks the model identity (name, architecture hash, dtype, weights fingerprint),
every leaf's shape, dtype and checksum, and the host files' own checksums and that they belong
to this save and device (the save id and device index in their meta); any mismatch, and a
missing or unreadable part, is a ValueError before the context is used. Paths may be relative
or start with ~.

Replacing a saved context (overwrite=True) swaps the new directory in with one atomic
renameat2(RENAME_EXCHANGE) where the file system has it; elsewhere the old one is first moved
aside to `.NAME.old-*`, which a crash between the two renames leaves behind (a load of the
missing path names it). Decode-time options (e.g. retrieval's top-k, speculation and tau) may
differ from those the context was prefilled with; options that shape the state may not.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import errno
import importlib
import json
import os
import pathlib
import shutil
import time
import uuid
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.generate import PrefilledContext, check_mesh, check_model
from kvjax.policies import make_policy
from kvjax.sharding import ShardedPolicy, join_state, replicated, split_state
from models.tensor_parallel import local_config

FORMAT = "kvjax-context"
VERSION = 9  # 2: freekv states carry the per_step exchange rows (step_*); 3: and promised_ids; 4: step_q, pool_slots,
# pool_counts; 5: kcodes, klo, kstep; 6: retrieval per_step buffers of topk + sources * successors + tail_slots
# rows (sources = successor_sources since ffdc098, topk before); 7: retrieval per_step rings of window + lag
# tokens past the sinks, no recent_* ring; 8: the manifest's own checksum (version 7 files, without it, still load);
# 9: a save id, also in each host file's meta with its device index, and the weights' fingerprint in the model
# identity (8 and 7 load without those checks)
_READABLE_VERSIONS = (7, 8, 9)
_STATE_MODULE_PREFIX = "kvjax."  # state classes are only ever imported from kvjax itself


def _crc32(array) -> int:
  return zlib.crc32(np.ascontiguousarray(np.asarray(array)).view(np.uint8)) & 0xFFFFFFFF


def _describe_tree(node, leaves: list):
  """JSON description of a state pytree of flax.struct dataclasses; arrays go to `leaves`."""
  if dataclasses.is_dataclass(node):
    cls = type(node)
    fields = {}
    for f in dataclasses.fields(node):
      value = getattr(node, f.name)
      if f.metadata.get("pytree_node", True):
        fields[f.name] = _describe_tree(value, leaves)
      else:  # static metadata (python scalars), part of the tree structure
        fields[f.name] = {"static": value}
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "fields": fields}
  leaves.append(node)
  return {"leaf": len(leaves) - 1}


def _build_tree(desc, leaves: list):
  if "leaf" in desc:
    return leaves[desc["leaf"]]
  if "static" in desc:
    return desc["static"]
  module_name, _, name = desc["class"].rpartition(".")
  if not module_name.startswith(_STATE_MODULE_PREFIX):
    raise ValueError(f"saved state names class {desc['class']!r} outside kvjax: refusing to load it")
  cls = getattr(importlib.import_module(module_name), name)
  return cls(**{field: _build_tree(sub, leaves) for field, sub in desc["fields"].items()})


def _manifest_crc(manifest: dict) -> int:
  """crc32 of the manifest's canonical JSON, its own checksum left out."""
  body = {k: v for k, v in manifest.items() if k != "crc32"}
  return zlib.crc32(json.dumps(body, sort_keys=True, default=_json_default).encode()) & 0xFFFFFFFF


def _fsync(path: pathlib.Path) -> None:
  """Flushes a file's or a directory's entries to the disk (a rename is durable once its directory is)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _check_replaceable(path: pathlib.Path) -> None:
  """overwrite=True replaces a saved context, never another file or directory."""
  found = None
  if not path.is_symlink() and path.is_dir() and (path / "manifest.json").is_file():
    try:
      found = json.loads((path / "manifest.json").read_text()).get("format")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, OSError):
      pass
  if found != FORMAT:
    raise ValueError(f"{str(path)!r} exists and is not a saved kvjax context: overwrite=True replaces only those")


def _policy_options(policy) -> dict:
  return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name != "name"}


def save_context(context: PrefilledContext, path: str | os.PathLike, *, overwrite: bool = False) -> None:
  """Writes `context` (not yet decoded) to the directory `path`, atomically.

  Args:
    context: from kvjax.prefill().
    path: the directory to create.
    overwrite: replace an existing saved context at `path` (only a saved context: any other
      file or directory there is refused); the old one stays in place until the new one is
      written.
  """
  import orbax.checkpoint as ocp

  if context.spent or context.state is None:
    raise ValueError("this context was decoded already; save it before decoding")
  path = _absolute(path)  # orbax takes absolute paths only
  if path.exists() or path.is_symlink():
    if not overwrite:
      raise ValueError(f"{str(path)!r} exists; pass overwrite=True to replace it")
    _check_replaceable(path)
  _check_metadata(context.metadata)
  policy, states = _per_device_states(context)
  arrays = {}
  for d, state in enumerate(states):
    leaves: list = []
    structure = _describe_tree(state, leaves)  # the same on every device
    prefix = "" if len(states) == 1 else f"dev{d}_"
    arrays |= {f"{prefix}leaf_{i}": leaf for i, leaf in enumerate(leaves)}
  arrays["last_hidden"] = context.last_hidden
  manifest = {
      "format": FORMAT,
      "version": VERSION,
      "model": _identity(context),
      "save_id": uuid.uuid4().hex,
      "policy": {"name": policy.name, "options": _policy_options(policy)},
      "prompt_lengths": list(context.prompt_lengths),
      "capacity": context.capacity,
      "devices": len(states),
      "prefill_seconds": context.prefill_seconds,
      "metadata": context.metadata,
      "structure": structure,
      "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "crc32": _crc32(v)} for k, v in arrays.items()},
      "host": None,
  }
  tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
  tmp.mkdir(parents=True)
  try:
    checkpointer = ocp.StandardCheckpointer()
    # orbax refuses zero-size arrays (e.g. a dense cache of no layers): the manifest's shape
    # and dtype recreate those.
    checkpointer.save(tmp / "state", {k: v for k, v in arrays.items() if v.size})
    checkpointer.wait_until_finished()
    hosts = [policy.host_context(state) for state in states]
    if hosts[0] is not None:
      names = ["host.bin"] if len(hosts) == 1 else [f"host_{d}.bin" for d in range(len(hosts))]
      for d, (host, name) in enumerate(zip(hosts, names)):
        host.save(tmp / name, meta=_host_meta(manifest, d))
      manifest["host"] = names[0] if len(hosts) == 1 else names
    manifest["crc32"] = _manifest_crc(manifest)
    with open(tmp / "manifest.json", "w") as f:
      f.write(json.dumps(manifest, indent=1, default=_json_default))
      f.flush()
      os.fsync(f.fileno())
    for entry in [*tmp.rglob("*"), tmp]:  # orbax fsyncs neither its metadata files nor the directories
      _fsync(entry)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _replace(tmp, path)


def _identity(context: PrefilledContext) -> dict:
  """The model identity a manifest records (and each host file's meta repeats)."""
  identity = {"name": context.model_name, "config_hash": context.config_hash, "dtype": context.dtype}
  return identity | ({"weights": context.weights} if context.weights else {})


def _absolute(path) -> pathlib.Path:
  return pathlib.Path(path).expanduser().absolute()  # not resolve(): a symlink stays one (refused)


def _host_meta(manifest: dict, device: int) -> dict:
  """What a host file's meta must hold: the model identity and, from version 9, the save and device it belongs to."""
  if "save_id" not in manifest:
    return manifest["model"]
  return manifest["model"] | {"save_id": manifest["save_id"], "device": device}


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
  """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
    return True
  if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system lacks it
    return False
  raise OSError(ctypes.get_errno(), f"swapping {str(a)!r} and {str(b)!r}")


def _replace(tmp: pathlib.Path, path: pathlib.Path) -> None:
  """Moves the written directory `tmp` to `path`. An old context at `path` is swapped out in one
  atomic step where the file system can; elsewhere it is kept until the new one is in place,
  and put back if that fails."""
  if path.exists():
    try:
      swapped = _exchange(tmp, path)
      if swapped:
        _fsync(path.parent)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)  # the new context, or the old one if swapped already
      raise
    if swapped:
      shutil.rmtree(tmp, ignore_errors=True)  # now the old context
      return
  old = None
  try:
    if path.exists():
      old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
      os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
  except BaseException:
    if old is not None and not path.exists():
      os.replace(old, path)
      old = None
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    if old is not None and path.exists():
      shutil.rmtree(old, ignore_errors=True)


def _check_metadata(metadata: dict) -> None:
  """The metadata goes to the manifest as JSON and must come back as it went in: string keys at
  every depth, JSON values (tuples as lists), checked before any work."""
  if not isinstance(metadata, dict):
    raise TypeError(f"context metadata must be a dict, got {type(metadata).__name__}")
  for key, value in metadata.items():
    if not isinstance(key, str):
      raise TypeError(f"context metadata key {key!r} is not a string (JSON keys are)")
    try:  # sort_keys, as the manifest's checksum writes it
      back = json.loads(json.dumps(value, sort_keys=True, default=_json_default))
    except (TypeError, ValueError) as e:
      raise TypeError(f"context metadata {key!r} cannot be written as JSON: {e}") from None
    if not _same_json(value, back):
      raise TypeError(f"context metadata {key!r} would not load back as saved (a non-string key inside?)")


def _same_json(value, back) -> bool:
  """value equals its JSON round trip `back`, tuples read as lists."""
  if isinstance(value, dict):
    return (isinstance(back, dict) and all(isinstance(k, str) for k in value) and value.keys() == back.keys()
            and all(_same_json(value[k], back[k]) for k in value))
  if isinstance(value, (list, tuple)):
    return isinstance(back, list) and len(value) == len(back) and all(map(_same_json, value, back))
  return value == back or (value != value and back != back)  # NaN


def _json_default(value):
  if isinstance(value, tuple):
    return list(value)
  if isinstance(value, np.generic):  # a NumPy scalar option (budget=np.int64(24))
    return value.item()
  raise TypeError(f"cannot write {type(value).__name__} to a context manifest")


def read_manifest(path: str | os.PathLike) -> dict:
  """The manifest of a saved context (format checked), without loading any array."""
  path = _absolute(path)
  manifest_file = path / "manifest.json"
  if not manifest_file.is_file():
    aside = sorted(path.parent.glob(f".{path.name}.old-*")) if not path.exists() else []
    if aside:  # an overwrite stopped between its two renames
      raise ValueError(f"{str(path)!r} is missing: an interrupted overwrite left the previous context at "
                       f"{str(aside[0])!r} (rename it back to use it)")
    raise ValueError(f"{str(path)!r} is not a saved kvjax context (no manifest.json)")
  try:
    manifest = json.loads(manifest_file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{str(manifest_file)!r} is corrupt: {e}") from None
  readable = isinstance(manifest, dict) and manifest.get("format") == FORMAT
  if not readable or manifest.get("version") not in _READABLE_VERSIONS:
    found = (manifest.get("format"), manifest.get("version")) if isinstance(manifest, dict) else (None, None)
    raise ValueError(f"{str(path)!r} holds format {found[0]!r} version {found[1]!r}, expected {FORMAT!r} version "
                     f"{' or '.join(map(str, _READABLE_VERSIONS))}")
  if manifest["version"] >= 8 and manifest.get("crc32") != _manifest_crc(manifest):
    raise ValueError(f"{str(manifest_file)!r} is corrupt: its checksum does not match its content")
  devices = manifest.get("devices", 1)
  hosts = manifest.get("host")
  names = [hosts] if isinstance(hosts, str) and devices == 1 else hosts
  if hosts is not None and not (isinstance(names, list) and len(names) == devices and all(
      isinstance(n, str) and n and n == pathlib.PurePath(n).name and n not in (".", "..") for n in names)):
    raise ValueError(f"{str(manifest_file)!r} is corrupt: host files {hosts!r} are not {devices} plain file name(s)")
  return manifest


def load_context(path: str | os.PathLike, model, *, policy_options: dict | None = None) -> PrefilledContext:
  """Reads a context written by `save_context` for `model`.

  Args:
    path: the saved context's directory.
    model: the model to decode with; it must be the model that prefilled the context.
    policy_options: decode-time options that override the saved ones (the policy's
      `decode_options`, e.g. topk, ef, speculative, tau for retrieval).
  """
  import orbax.checkpoint as ocp

  path = _absolute(path)
  manifest = read_manifest(path)
  identity = manifest["model"]
  probe = PrefilledContext(model_name=identity["name"], config_hash=identity["config_hash"], dtype=identity["dtype"],
                           policy=None, state=None, prompt_lengths=[], capacity=0, last_hidden=None,
                           weights=identity.get("weights", ""))
  check_model(model, probe)

  devices = int(manifest.get("devices", 1))
  mesh = getattr(model, "mesh", None)
  if (1 if mesh is None else mesh.size) != devices:
    raise ValueError(f"{str(path)!r} was prefilled over {devices} device(s); the model is on "
                     f"{1 if mesh is None else mesh.size}: load it with a model sharded the same way")
  policy = _restore_policy(manifest["policy"], policy_options or {})
  hosts = manifest["host"] if isinstance(manifest["host"], list) else [manifest["host"]] * devices
  missing = [str(path / p) for p in ["state", *(h for h in hosts if h)] if not (path / p).exists()]
  if missing:
    raise ValueError(f"saved context {str(path)!r} is incomplete: {missing} missing")
  try:
    restored = ocp.StandardCheckpointer().restore(path / "state")
  except Exception as e:  # orbax raises what its readers raise on a truncated or damaged file
    raise ValueError(f"the state of saved context {str(path)!r} is unreadable: {type(e).__name__}: {e}") from e
  arrays = {}  # checked while still on the host, then placed on their own device only
  for key, spec in manifest["arrays"].items():
    if 0 in spec["shape"]:
      array = np.zeros(spec["shape"], spec["dtype"])
    elif key in restored:
      array = np.asarray(restored[key])
    else:
      raise ValueError(f"saved context {str(path)!r} lacks array {key!r}")
    if list(array.shape) != spec["shape"] or str(array.dtype) != spec["dtype"] or _crc32(array) != spec["crc32"]:
      raise ValueError(f"array {key!r} of {str(path)!r} does not match its manifest (shape, dtype or checksum)")
    arrays[key] = array
  del restored
  leaves, host_contexts = [], []
  for d, device in enumerate(_devices(mesh)):
    prefix = "" if devices == 1 else f"dev{d}_"
    count = sum(1 for key in arrays if key.startswith(prefix + "leaf_"))
    leaves.append([jax.device_put(arrays.pop(f"{prefix}leaf_{i}"), device) for i in range(count)])
    if hosts[d] is None:
      host_contexts.append(None)
    else:
      import host_index

      host_contexts.append(host_index.HostContext.load(path / hosts[d], expect_meta=_host_meta(manifest, d)))
  return _assemble(model, policy, [_build_tree(manifest["structure"], x) for x in leaves], host_contexts,
                   identity=identity, prompt_lengths=list(manifest["prompt_lengths"]),
                   capacity=int(manifest["capacity"]), last_hidden=jnp.asarray(arrays["last_hidden"]),
                   prefill_seconds=float(manifest["prefill_seconds"]), metadata=dict(manifest.get("metadata") or {}))


def copy_context(context: PrefilledContext, model, *, policy_options: dict | None = None) -> PrefilledContext:
  """An independent copy of `context` (not yet decoded) in memory: what `save_context` then
  `load_context(..., policy_options=...)` give, without the disk or its checksums.

  Decode consumes a context, so comparing decode options on one prefill means a copy per
  decode: copy first, then decode the copies and the original in any order. A copy holds its
  own device state and host store until it is decoded or closed: for a dense cache at long
  context (`full`), saving and loading one decode at a time needs half the device memory.

  Args:
    context: from kvjax.prefill() or load_context(), not decoded yet.
    model: the model that prefilled it.
    policy_options: decode-time options that override the context's (as in load_context).
  """
  if context.spent or context.state is None:
    raise ValueError("this context was decoded already; copy it before decoding")
  check_model(model, context)
  check_mesh(model, context)
  policy, states = _per_device_states(context)
  new_policy = _restore_policy({"name": policy.name, "options": _policy_options(policy)}, policy_options or {})
  t0 = time.perf_counter()
  hosts = []
  for state in states:
    host = policy.host_context(state)
    hosts.append(None if host is None else host.copy())
  t1 = time.perf_counter()
  fresh = lambda array: jnp.array(array, copy=True)  # decode donates the copy's buffers, not the original's
  # Waited for, so that each part's time is its own (the copies are dispatched asynchronously).
  new_states, last_hidden = jax.block_until_ready(([jax.tree.map(fresh, state) for state in states],
                                                   fresh(context.last_hidden)))
  t2 = time.perf_counter()
  copied = _assemble(model, new_policy, new_states, hosts, identity=_identity(context),
                     prompt_lengths=list(context.prompt_lengths), capacity=context.capacity, last_hidden=last_hidden,
                     prefill_seconds=context.prefill_seconds, metadata=copy.deepcopy(context.metadata))
  jax.block_until_ready(copied.state)
  copied.setup_times = {"host_s": t1 - t0, "device_s": t2 - t1, "attach_s": time.perf_counter() - t2}
  return copied


def _devices(mesh) -> list:
  return [None] if mesh is None else list(mesh.devices.flat)


def _assemble(model, policy, states, hosts, *, identity, prompt_lengths, capacity, last_hidden, prefill_seconds,
              metadata) -> PrefilledContext:
  """A context from each device's state and host context (None for device-only policies): every
  host context gets a new runtime and its decode room, as after a prefill."""
  mesh = getattr(model, "mesh", None)
  cfg = model.cfg if mesh is None else local_config(model.cfg, len(states))
  attached = []
  try:
    for state, host, device in zip(states, hosts, _devices(mesh)):
      with jax.default_device(device):  # each device's share (and its runtime's work) on that device
        if host is not None:
          state = policy.attach_host(cfg, state, host)
        attached.append(state)
        if host is not None:
          policy.reserve_decode_room(cfg, host, capacity)  # not saved: room, not data
  except BaseException:
    for state, host in zip(attached, hosts):
      if host is not None:
        policy.release_fn(state)()  # no runtime (nor its host memory) outlives a failed load or copy
    raise
  if mesh is None:
    state = attached[0]
  else:
    policy, state, last_hidden = ShardedPolicy(policy, mesh), join_state(attached, mesh), replicated(last_hidden, mesh)
  return PrefilledContext(
      model_name=identity["name"], config_hash=identity["config_hash"], dtype=identity["dtype"], policy=policy,
      state=state, prompt_lengths=prompt_lengths, capacity=capacity, last_hidden=last_hidden,
      prefill_seconds=prefill_seconds, metadata=metadata, weights=identity.get("weights", ""),
      _release=policy.release_fn(state))


def _per_device_states(context: PrefilledContext):
  """(the policy that made each device's share, [the state of each device]); one device: as is."""
  if isinstance(context.policy, ShardedPolicy):
    return context.policy.inner, split_state(context.state, context.policy.mesh)
  return context.policy, [context.state]


def _restore_policy(saved: dict, overrides: dict):
  options = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["options"].items()}
  base = make_policy(saved["name"], **options)
  allowed = set(getattr(base, "decode_options", ()))
  refused = sorted(set(overrides) - allowed)
  if refused:
    raise ValueError(f"options {refused} shape the saved state of policy {saved['name']!r} and cannot change "
                     f"at decode; changeable: {sorted(allowed)}")
  return make_policy(saved["name"], **(options | overrides))
