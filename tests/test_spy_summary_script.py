"""scripts/spy_summary.py: one thread's busy samples from a py-spy raw recording, by function."""

from __future__ import annotations

import gzip
import json

from script_loader import load_script

spy = load_script("spy_summary")

RAW = """\
thread (11): gpuloom-runtime-dstack;Runtime._serve (core.py:317);SemaphoreWaker.wait (waker.py:88) 50
thread (11): gpuloom-runtime-dstack;Runtime._serve (core.py:317);_LoopIntake.poll (frontend.py:640) 7
thread (11): gpuloom-runtime-dstack;Runtime._serve (core.py:318);InferenceService._settle (service.py:880);Future.set_result (_base.py:540);_Eventfd.post (ring.py:146) 4
thread (11): gpuloom-runtime-dstack;Runtime._serve (core.py:318);InferenceService._settle (service.py:881);Histogram.add (books.py:39) 1
thread (12): MainThread;main (x.py:3);Condition.wait (threading.py:320) 99
not a stack line
"""


def test_a_threads_waiting_samples_are_apart_and_functions_count_once_per_sample_with_line_numbers_merged():
    s = spy.summarize(spy.parse(RAW.splitlines()), "gpuloom-runtime")
    assert (s["samples"], s["waiting"], s["busy"]) == (62, 50, 12)  # MainThread's left out
    inclusive = dict(s["inclusive"])
    assert inclusive["Runtime._serve (core.py)"] == 12  # lines 317 and 318: one function
    assert inclusive["InferenceService._settle (service.py)"] == 5
    assert inclusive["_LoopIntake.poll (frontend.py)"] == 7  # a poll that returns is busy, not waiting
    assert dict(s["leaf"])["_Eventfd.post (ring.py)"] == 4


def test_below_a_root_only_its_samples_count(tmp_path, capsys):
    s = spy.summarize(spy.parse(RAW.splitlines()), "gpuloom-runtime", root="InferenceService._settle")
    assert s["busy"] == 5 and s["inclusive"][0] == ("InferenceService._settle (service.py)", 5)
    assert dict(s["inclusive"])["_Eventfd.post (ring.py)"] == 4
    rec = tmp_path / "spy.txt"
    rec.write_text(RAW)
    out = tmp_path / "s.json"
    assert spy.main([str(rec), "--root", "InferenceService._settle", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "5 busy below InferenceService._settle" in text and "80.0%  _Eventfd.post (ring.py)" in text
    assert json.loads(out.read_text())["busy"] == 5
    packed = tmp_path / "spy.txt.gz"  # as kept under docs/results
    packed.write_bytes(gzip.compress(RAW.encode()))
    assert spy.main([str(packed), "--root", "InferenceService._settle"]) == 0
    assert "5 busy below InferenceService._settle" in capsys.readouterr().out
    assert spy.main([str(rec), "--thread", "no-such-thread"]) == 2
    assert "no samples of a thread named like 'no-such-thread'" in capsys.readouterr().err
