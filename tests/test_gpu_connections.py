"""The process asks for all 32 hardware workqueues before CUDA starts (gpuloom/gpu/connections.py)."""

import os
import subprocess
import sys

import pytest

from gpuloom.gpu import connections as conn


def test_an_unset_variable_becomes_32_before_cuda_starts():
    env: dict[str, str] = {}
    got = conn.prefer_all_connections(env, cuda_started=lambda: False)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert (got.count, got.source, got.warning) == (32, "gpuloom", "")
    assert got.as_meta() == {"cuda_device_max_connections": 32, "cuda_device_max_connections_source": "gpuloom"}


def test_a_value_the_user_set_is_kept():
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    got = conn.prefer_all_connections(env, cuda_started=lambda: False)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"} and (got.count, got.source) == (8, "user")


def test_too_late_leaves_the_environment_alone_and_warns_how_to_fix_it():
    env: dict[str, str] = {}
    got = conn.prefer_all_connections(env, cuda_started=lambda: True)
    assert env == {} and (got.count, got.source) == (8, "late")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in got.warning and "before CUDA starts" in got.warning


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5", "1_6", "\u00b2", "\u0663"])
def test_a_value_that_is_not_a_count_is_left_alone_with_a_warning(value):
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": value}
    got = conn.prefer_all_connections(env, cuda_started=lambda: False)
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": value} and (got.count, got.source) == (8, "invalid")
    assert repr(value) in got.warning and "1 to 32" in got.warning


def test_a_bad_value_does_not_stop_the_command_line():
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="abc")
    out = subprocess.run([sys.executable, "-m", "gpuloom.cli", "plan", "--help"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "usage" in out.stdout
    assert "warning: CUDA_DEVICE_MAX_CONNECTIONS='abc' is not a number" in out.stderr


def test_only_the_process_environment_counts_as_set_by_gpuloom(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(conn, "_set_value", None)
    conn.prefer_all_connections({}, cuda_started=lambda: False)  # a dict: the process's record is untouched
    assert conn._set_value is None and conn.connections_in_effect().source == "default"
    assert conn.prefer_all_connections(cuda_started=lambda: False).source == "gpuloom"
    assert conn.connections_in_effect().as_meta() == {"cuda_device_max_connections": 32,
                                                      "cuda_device_max_connections_source": "gpuloom"}
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")  # changed by the user afterwards
    assert conn.connections_in_effect().source == "user"


def test_the_driver_caps_at_32_and_an_unset_variable_reads_as_its_default_8():
    assert conn.connections_in_effect({"CUDA_DEVICE_MAX_CONNECTIONS": "64"}).count == 32
    assert (conn.connections_in_effect({}).count, conn.connections_in_effect({}).source) == (8, "default")


def test_the_command_line_sets_it_before_any_command_runs():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    code = ("import os, sys\nfrom gpuloom import cli\ntry:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print('value', os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("value 32")
