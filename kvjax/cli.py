"""absl flags shared by experiments/decode.py and the study scripts, and their checks.

Policy flags default to None ("not given"): a flag given for a policy that does not use it
is an error rather than silently ignored.
"""

from __future__ import annotations

from absl import app, flags

from models.config import RopeScaling

# The policy option each policy-specific flag maps to; a policy accepts the flags whose option
# names are fields of its dataclass.
POLICY_FLAGS = {
    "index": "index",
    "retrieval_topk": "topk",
    "sinks": "sinks",
    "window": "window",
    "budget": "budget",
    "page_size": "page_size",
    "speculative": "speculative",
    "tau": "tau",
    "correct_mass": "correct_mass",
    "dense_layers": "dense_layers",
    "bridge": "bridge",
    "roar_heads": "roar_heads",
    "lag": "lag",
    "successors": "successors",
    "successor_sources": "successor_sources",
    "pinned": "pinned",
    "pinned_span": "pinned_span",
    "pinned_window": "pinned_window",
    "tail_slots": "tail_slots",
    "refresh": "refresh",
    "search_query": "search_query",
    "group_rows": "group_rows",
    "transfer": "transfer",
    "page_summary": "page_summary",
    "host_codec": "host_codec",
    "background_nice": "background_nice",
    "ef_insert": "ef_insert",
    "index_every": "index_every",
}


def define_flags() -> None:
  """Defines the shared flags (call once at import time of a CLI)."""
  flags.DEFINE_string("model", "smollm2", "Model name (smollm2, gemma3-270m, qwen2.5-0.5b, random:tiny, "
                      "random:llama3-8b, ...), a .gguf file, or a Hugging Face checkpoint directory.")
  flags.DEFINE_string("prompt", None, "Prompt text; default: the built-in pass-key prompt.")
  flags.DEFINE_string("prompt_file", None, "Read the prompt from this file.")
  flags.DEFINE_integer("context_len", None, "Approximate prompt length in tokens for the built-in prompt "
                       "(random token ids for random models); default ~6K.")
  flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate.")
  flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
  flags.DEFINE_integer("seed", 0, "Seed of the prompt generator and the sampler.")
  flags.DEFINE_integer("batch", 1, "Copies of the prompt decoded together.")
  flags.DEFINE_string("policy", "full", "Attention policy.")
  flags.DEFINE_string("index", None, "Host index kind (retrieval): roar, graph, ivf or flat.")
  flags.DEFINE_integer("retrieval_topk", None, "Keys retrieved per query head and step (retrieval).")
  flags.DEFINE_integer("sinks", None, "First tokens kept on the device.")
  flags.DEFINE_integer("window", None, "Most recent tokens kept on the device.")
  flags.DEFINE_integer("budget", None, "Tokens attended per step (sinks + window + selected).")
  flags.DEFINE_integer("page_size", None, "Tokens per page (freekv, quest).")
  flags.DEFINE_boolean("speculative", None, "Reuse the previous step's selection, correct drifted heads.")
  flags.DEFINE_float("tau", None, "Correction threshold on the group-mean query cosine similarity.")
  flags.DEFINE_float("correct_mass", None, "freekv --speculative: also correct heads whose reused pages lack more "
                     "than this share of the current query's pooled page scores (default: the cosine rule alone).")
  flags.DEFINE_list("dense_layers", None, "Layers kept dense under a sparse policy.")
  flags.DEFINE_enum("bridge", None, ["per_layer", "per_step"],
                    "Host bridge of retrieval and freekv: a callback per layer inside the step, or one host "
                    "exchange between steps (previous step's selection, no host inside the step).")
  flags.DEFINE_integer("lag", None, "per_step bridge: rows used at step t were selected with the query of "
                       "step t - lag (1: host works between steps; 2: while the device computes; 0, retrieval: "
                       "each step runs twice, the second on rows its own first-pass queries found).")
  flags.DEFINE_integer("successors", None, "retrieval per_step bridge: tokens following each retrieved one also "
                       "attended (default: 2 * lag; 0: none), for heads that read on from where a previous step's query "
                       "found them.")
  flags.DEFINE_integer("successor_sources", None, "retrieval per_step bridge: how many of each head's best "
                       "retrieved ids get successors (default 8).")
  flags.DEFINE_integer("pinned", None, "retrieval per_step bridge: each query head's best ids for the prompt's last "
                       "query kept in every step's selection, with the tokens after them (default 16, at most topk; "
                       "0: none).")
  flags.DEFINE_integer("pinned_span", None, "retrieval per_step bridge: tokens kept from each pinned id on "
                       "(default 16).")
  flags.DEFINE_integer("pinned_window", None, "retrieval per_step bridge: the last prompt queries whose summed "
                       "attention chooses the pinned ids (default 32, at most the window; 1: the last query's search).")
  flags.DEFINE_integer("tail_slots", None, "retrieval per_step bridge: rows per query head for tokens stored since "
                       "its latest search; with --speculative a group that does not drift is refreshed every "
                       "tail_slots / 2 steps (default 16; 8, the default before 2026-12-06, took 1.07-1.17x the "
                       "time a token at 128K on three H100 machines, at the same accuracy within a sample or two).")
  flags.DEFINE_enum("refresh", None, ["search", "merge"], "retrieval per_step --speculative: a group whose query "
                    "has not drifted is refreshed on its turn by searching again (default) or by merging the tokens "
                    "stored since into its top-k, scored with the query of its latest search (no graph search).")
  flags.DEFINE_enum("search_query", None, ["head", "group_mean"], "retrieval per_step bridge: each query head's "
                    "rows are searched with its own query (default) or its KV group's mean query (the group's heads "
                    "then hold the same top-k).")
  flags.DEFINE_boolean("group_rows", None, "retrieval per_step bridge: each query head also attends the rows its "
                       "KV group's other heads retrieved, each distinct row once (no more searches or rows).")
  flags.DEFINE_enum("transfer", None, ["page_locked", "pageable", "pinned"],
                    "per_step bridge: how each step's host update reaches the device: from its buffer locked in "
                    "place (default), from pageable memory, or through a copy into JAX's pinned host memory.")
  flags.DEFINE_enum("page_summary", None, ["minmax", "keys2", "keys4"],
                    "freekv: page scores from per-page key min/max (FreeKV) or from every key at 2 / 4 bits.")
  flags.DEFINE_enum("host_codec", None, ["none", "int8"],
                    "freekv: host K/V in the model's dtype, or int8 with a scale per token and head (0.52x the "
                    "bytes at head_dim 128; encoded and decoded on the device).")
  flags.DEFINE_integer("background_nice", None, "retrieval, freekv: Linux nice value (0-19) of the host threads "
                       "working while the device computes, so they yield the cores to the kernel launches (default "
                       "10; 0: unchanged).")
  flags.DEFINE_integer("ef_insert", None, "retrieval (graph, roar): candidate list of each decode-time insert's "
                       "beam searches (default: 32 for roar, the index's own for graph); roar's build-time 64 (the "
                       "default until session 48) took 1.56-1.59x full's time a token at 128K against 1.28-1.35x, "
                       "for 2.3 points more recall of the inserted keys at 8K.")
  flags.DEFINE_integer("index_every", None, "retrieval per_step bridge: index each layer's evicted tokens in runs, "
                       "every this many steps (layers staggered; attended exactly from the tail slots until then); "
                       "default 8 (at most tail_slots // 2): 1.29-1.30x full's time a token at 128K on an H100 "
                       "against 1.39-1.51x with 1.")
  flags.DEFINE_enum("roar_heads", None, ["query", "kv"], "Roar graphs per query head or per KV head.")
  flags.DEFINE_string("rope_scaling", None, "RoPE scaling as kind:factor (linear, dynamic, yarn, llama3).")
  flags.DEFINE_string("dtype", "auto", "Weight and KV dtype: auto (bfloat16 on GPU, float32 on CPU), "
                      "float32, bfloat16 or float16.")
  flags.DEFINE_enum("layout", "auto", ["auto", "stacked", "unrolled"],
                    "Parameter layout: stacked layers under lax.scan, or unrolled per-layer weights with "
                    "fused projections (auto: unrolled for large models on a GPU).")
  flags.DEFINE_string("save_context", None, "Save the prefilled context to this path.")
  flags.DEFINE_string("load_context", None, "Decode from a saved context instead of prefilling.")
  flags.DEFINE_integer("prefill_chunk", 1024, "Prompt tokens per prefill step.")
  flags.DEFINE_boolean("layer_major", False, "Prefill every chunk through one layer before the next (retrieval and "
                       "freekv then hold one layer's prompt KV on the device at a time).")


def parse_rope_scaling(spec: str | None, original_max_position: int) -> RopeScaling | None:
  """'linear:4' -> RopeScaling(kind='linear', factor=4, original_max_position=...)."""
  if not spec:
    return None
  kind, sep, factor = spec.partition(":")
  if not sep:
    raise app.UsageError(f"--rope_scaling={spec!r} must look like kind:factor, e.g. yarn:4")
  try:
    value = float(factor)
  except ValueError:
    raise app.UsageError(f"--rope_scaling factor {factor!r} is not a number") from None
  try:
    return RopeScaling(kind=kind, factor=value, original_max_position=original_max_position)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def policy_options(policy_cls, flag_values, *, policy_name: str | None = None) -> dict:
  """Options for `policy_cls` from the given policy flags; an inapplicable flag is an error."""
  policy_name = policy_name or flag_values.policy
  fields = set(getattr(policy_cls, "__dataclass_fields__", {}))
  options = {}
  for flag, option in POLICY_FLAGS.items():
    value = getattr(flag_values, flag)
    if value is None:
      continue
    if option not in fields:
      raise app.UsageError(f"--{flag} does not apply to --policy={policy_name}")
    if flag == "dense_layers":
      try:
        value = tuple(int(x) for x in value)
      except ValueError:
        raise app.UsageError(f"--dense_layers={','.join(value)}: layer ids are integers") from None
    options[option] = value
  return options


def resolve_dtype(spec: str) -> str:
  import jax

  if spec == "auto":
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"
  if spec not in ("float32", "bfloat16", "float16"):
    raise app.UsageError(f"--dtype={spec!r}; expected auto, float32, bfloat16 or float16")
  return spec
