"""``gpuloom cache``: where the caches are, what they hold, and a purge that removes only gpuloom's files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuloom.cli import main


@pytest.fixture
def caches(tmp_path, monkeypatch):
    profiles, graphs = tmp_path / "profiles", tmp_path / "graphs"
    (profiles / "NVIDIA_H200-132sm").mkdir(parents=True)
    (profiles / "NVIDIA_H200-132sm" / "tiny_mlp-0123456789abcdef.json").write_text("{}" * 50)
    (profiles / "NVIDIA_H200-132sm" / ".tiny_mlp.abc.tmp").write_text("x")  # a write that never finished
    graphs.mkdir()
    for i in range(3):
        (graphs / f"{i:032x}.json").write_text("g" * 1000)
    (graphs / "notes.txt").write_text("the user's own")  # not gpuloom's: a purge keeps it
    (graphs / "sub").mkdir()
    (graphs / "sub" / "kept.json").write_text("{}")
    monkeypatch.setenv("GPULOOM_PROFILE_CACHE", str(profiles))
    monkeypatch.setenv("GPULOOM_GRAPH_CACHE", str(graphs))
    return profiles, graphs


def test_dir_names_both_caches_and_follows_the_environment(caches, capsys):
    profiles, graphs = caches
    assert main(["cache", "dir"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"profiles: {profiles}", f"graphs: {graphs}"]
    assert main(["cache", "dir", "graphs", "--graph-cache", "none"]) == 0
    assert capsys.readouterr().out.strip() == "graphs: off"
    assert main(["cache", "purge", "--profile-cache", "none", "--graph-cache", "none"]) == 0
    assert capsys.readouterr().out.splitlines() == ["profiles: off, nothing to remove", "graphs: off, nothing to remove"]
    assert len(list(profiles.rglob("*.json"))) == 1 and len(list(graphs.glob("*.json"))) == 3


def test_info_counts_gpuloom_files_and_their_size(caches, capsys):
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": 2 files, 101 B")
    assert out[1].endswith(": 3 files, 2.9 KiB, at most 512.0 MiB")


def test_purge_removes_only_gpuloom_files_of_the_cache_asked_for(caches, capsys):
    profiles, graphs = caches
    assert main(["cache", "purge", "graphs"]) == 0
    assert "graphs: removed 3 files (2.9 KiB)" in capsys.readouterr().out
    assert sorted(p.name for p in graphs.rglob("*")) == ["kept.json", "notes.txt", "sub"]
    assert len(list(profiles.rglob("*.json"))) == 1  # the other cache is untouched
    assert main(["cache", "purge"]) == 0
    assert "profiles: removed 2 files" in capsys.readouterr().out
    assert not list(profiles.rglob("*.json")) and not list(profiles.rglob("*.tmp"))
    assert (profiles / "NVIDIA_H200-132sm").is_dir()  # directories stay


def test_a_missing_directory_is_an_empty_cache(tmp_path, capsys):
    gone = tmp_path / "never-made"
    assert main(["cache", "info", "graphs", "--graph-cache", str(gone)]) == 0
    assert capsys.readouterr().out.strip() == f"graphs: {gone}: 0 files, 0 B, at most 512.0 MiB"
    assert main(["cache", "purge", "graphs", "--graph-cache", str(gone)]) == 0
    assert not gone.exists()


def test_the_cache_command_does_not_import_torch(caches):
    code = "import sys; from gpuloom.cli import main; main(['cache', 'info']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("word", ["none", "0", "OFF", " false ", "no"])
def test_every_cache_reads_the_same_words_as_off(caches, capsys, word):
    # one rule for both caches (gpuloom.cachedirs): `--profile-cache off` once named a directory "off"
    assert main(["cache", "dir", "--profile-cache", word, "--graph-cache", word]) == 0
    assert capsys.readouterr().out.splitlines() == ["profiles: off", "graphs: off"]


def test_both_caches_live_under_the_users_cache_directory(tmp_path, monkeypatch):
    from gpuloom.engine import graph_cache
    from gpuloom.profile.cache import default_cache_dir

    monkeypatch.delenv("GPULOOM_PROFILE_CACHE", raising=False)
    monkeypatch.delenv("GPULOOM_GRAPH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "gpuloom" / "profiles"
    assert graph_cache.cache_dir() == tmp_path / "gpuloom" / "graphs"
