"""README's accuracy table (experiments/accuracy_table.py): what README shows is what the results
files it cites give under today's paired rule, and a cell that names a missing policy or file is
refused by name."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import accuracy_table  # noqa: E402


def test_readme_table_is_what_the_results_files_give():
  written = accuracy_table.readme_block(accuracy_table.README.read_text())
  assert written == accuracy_table.table(), (
      "README.md's accuracy table differs from the results files: run python experiments/accuracy_table.py --readme")


def _write_results(directory: pathlib.Path, stem: str, rows: list[dict], *, device="cpu:cpu", commit="abc1234def") -> None:
  doc = {"device": device, "jax": "0.11.2", "commit": commit, "date": "2026-12-07", "command": "python eval_ruler.py",
         "rows": rows}
  (directory / f"{stem}.json").write_text(json.dumps(doc))


def _rows(policy: str, scores: dict[int, float], task="niah_single_1", length=4096) -> list[dict]:
  return [{"task": task, "length": length, "seed": seed, "policy": policy, "score": score}
          for seed, score in scores.items()]


def test_a_cell_is_paired_with_full_over_the_shared_seeds(tmp_path, monkeypatch):
  monkeypatch.setattr(accuracy_table, "RESULTS", tmp_path)
  full = {s: 1.0 for s in range(6)}
  fast = {s: 1.0 for s in range(6)} | {2: 0.0, 7: 1.0}  # seed 7 has no full row: left out
  _write_results(tmp_path, "run", _rows("full", full) + _rows("fast", fast), device="gpu:NVIDIA H200",
                 commit="1111111aaaa, 2222222bbbb")
  row = accuracy_table.cell_row(accuracy_table.Cell("M", "niah_single_1", 4096, "run", "fast", "fast"))
  assert (row["n"], row["seeds"], row["lost / won"]) == ("6", "0-5", "1 / 0")
  assert (row["full"], row["score"], row["hardware"]) == ("1.000", "0.833", "H200 bf16")
  assert row["commit"] == "1111111 … 2222222 (2)"
  assert row["loss [95% CI]"].startswith("0.167 [0.000, ")
  assert row["verdict"] == "inconclusive"  # one of six lost: neither a loss the interval shows nor ruled out


def test_a_missing_policy_or_file_is_refused_by_name(tmp_path, monkeypatch):
  monkeypatch.setattr(accuracy_table, "RESULTS", tmp_path)
  _write_results(tmp_path, "run", _rows("full", {0: 1.0}) + _rows("fast", {0: 1.0}))
  with pytest.raises(ValueError, match="no policy 'slow' paired with full.*policies there: \\['fast'\\]"):
    accuracy_table.cell_row(accuracy_table.Cell("M", "niah_single_1", 4096, "run", "slow", "slow"))
  with pytest.raises(ValueError, match="results file 'gone'"):
    accuracy_table.cell_row(accuracy_table.Cell("M", "niah_single_1", 4096, "gone", "fast", "fast"))


def test_readme_markers_must_appear_once_in_order():
  with pytest.raises(ValueError, match="accuracy-table:begin"):
    accuracy_table.readme_block("no markers here")
  text = f"a\n{accuracy_table.BEGIN}\nold\n{accuracy_table.END}\nb"
  assert accuracy_table.with_table(text, "new\n") == f"a\n{accuracy_table.BEGIN}\nnew\n{accuracy_table.END}\nb"
