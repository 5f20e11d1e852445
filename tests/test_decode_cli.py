"""experiments/decode.py: flag checks and the save/load round trip, on a random tiny model."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def decode(*flags, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(REPO))
  return subprocess.run([sys.executable, str(REPO / "experiments" / "decode.py"), *flags],
                        capture_output=True, text=True, env=env, timeout=timeout)


def test_save_then_load_context_gives_the_same_tokens(tmp_path):
  common = ["--model=random:tiny", "--max_new_tokens=12"]
  saved = decode(*common, "--context_len=700", "--policy=retrieval", "--index=flat", "--sinks=16",
                 "--window=64", "--layer_major", f"--save_context={tmp_path / 'ctx'}",
                 f"--json_out={tmp_path / 'a.json'}")
  assert saved.returncode == 0, saved.stderr[-3000:]
  loaded = decode(*common, f"--load_context={tmp_path / 'ctx'}", f"--json_out={tmp_path / 'b.json'}")
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
  assert a["answer"] == b["answer"]
  assert b["context"].startswith("loaded from")
  assert a["device"] and a["commit"] and a["jax"]  # results are stamped


def test_a_single_token_report_is_strict_json(tmp_path):
  """No decode step runs: its ms per token was written as NaN, which JSON does not allow."""
  run = decode("--model=random:tiny", "--context_len=100", "--max_new_tokens=1", f"--json_out={tmp_path / 'a.json'}")
  assert run.returncode == 0, run.stderr[-3000:]

  def refuse(constant):
    raise AssertionError(f"{constant} in the report")

  report = json.loads((tmp_path / "a.json").read_text(), parse_constant=refuse)
  assert report["decode_ms_per_token"] is None and report["generated_tokens"] == 1


def test_flags_that_do_not_apply_are_errors(tmp_path):
  bad = decode("--model=random:tiny", "--context_len=100", "--policy=full", "--retrieval_topk=5", timeout=300)
  assert bad.returncode != 0 and "--retrieval_topk does not apply to --policy=full" in bad.stderr
  staged = decode("--model=random:tiny", f"--load_context={tmp_path / 'none'}", "--layer_major", timeout=300)
  assert staged.returncode != 0 and "--layer_major does not apply with --load_context" in staged.stderr
  missing = decode("--model=random:tiny", f"--load_context={tmp_path / 'none'}", timeout=300)
  assert missing.returncode != 0 and "not a saved kvjax context" in missing.stderr


def test_bad_flag_values_fail_before_any_work(tmp_path):
  """Checked before the model loads: a bad sampling flag once failed after the prefill and the save."""
  cases = [(["--temperature=-1", f"--save_context={tmp_path / 'x'}"], "temperature=-1.0 must be >= 0.0"),
           (["--top_p=0.5"], "--top_p=0.5 needs --temperature > 0"),
           (["--context_len=0"], "--context_len=0 must be >= 1"),
           (["--context_len=100", "--prompt=hi"], "--context_len sizes the built-in prompt"),
           (["--batch=0"], "--batch=0 must be >= 1"),
           (["--max_new_tokens=0"], "--max_new_tokens=0 must be >= 1"),
           (["--prefill_chunk=0"], "--prefill_chunk=0 must be >= 1"),
           (["--policy=quest", "--budget=10"], "budget=10 is smaller than the sinks"),
           (["--policy=retrieval", "--dense_layers=1.5"], "--dense_layers=1.5: layer ids are integers"),
           (["--policy=retrieval", "--refresh=merge"], "refresh='merge' applies to bridge='per_step' with speculative"),
           (["--policy=retrieval", "--bridge=per_step", "--tail_slots=0"], "tail_slots=0"),
           (["--policy=retrieval", "--ef_insert=0"], "ef_insert=0"),
           (["--policy=retrieval", "--index=ivf", "--ef_insert=32"], "ef_insert=32 applies to index='graph' or 'roar'")]
  for flags, message in cases:
    bad = decode("--model=random:tiny", *flags, timeout=300)
    assert bad.returncode != 0 and message in bad.stderr, (flags, bad.stderr[-500:])
    assert "Traceback" not in bad.stderr, (flags, bad.stderr[-500:])  # a usage error, not a crash
  assert not (tmp_path / "x").exists()
