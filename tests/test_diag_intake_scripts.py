"""scripts/diag_intake_cost.py and scripts/diag_intake_ab.py run end to end on the fake device: every
record taken is answered, and the figures they report are the loop's own, per request."""

from __future__ import annotations

import json
from pathlib import Path

from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_the_intake_cost_diagnostic_answers_every_record_it_takes_on_the_loop(tmp_path):
    out = tmp_path / "cost.json"
    assert load_script("diag_intake_cost").main(["--requests", "60", "--repeat", "2", "--burst", "3",
                                                  "--pause-ms", "0.2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["replies"] for r in got["reps"]] == [60, 60] and all(r["errors"] == 0 for r in got["reps"])
    assert got["intake_us_min"] > 0 and got["answer_us_median"] > 0


def test_the_ab_diagnostic_runs_both_checkouts_in_turns_and_sums_up_the_pairs(tmp_path):
    out = tmp_path / "ab.json"
    ab = load_script("diag_intake_ab")
    assert ab.main(["--base", str(ROOT), "--pairs", "2", "--requests", "40", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert len(got["pairs"]) == 2 and all(p["base"]["intake_us"] > 0 and p["new"]["answer_us"] > 0
                                          for p in got["pairs"])
    s = got["summary"]["intake_us"]
    assert s["pairs"] == 2 and 0 <= s["new_lower_in"] <= 2
    assert s["base_mean"] == sum(p["base"]["intake_us"] for p in got["pairs"]) / 2
