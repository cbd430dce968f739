"""services.cache_cmd (`kvfleet cache`): entries listed with their size and last use; prune removes the model
entries unused for longer than asked, never one being made (its lock held) nor the CPU kernels."""

import fcntl
import os
import time

import pytest

from services.cache_cmd import entries, prune
from services.cli import main
from shared.models import mark_used

pytestmark = pytest.mark.unit

DAY = 86400


def make(root, kind, name, age_days, size=1000):
    path = root / kind / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x" * size)
    (root / kind / f"{name}.lock").touch()
    t = time.time() - age_days * DAY
    os.utime(path, (t, t))
    return path


def test_prune_removes_only_old_model_entries_not_in_use(tmp_path):
    old = make(tmp_path, "gguf", "old-1", 10)
    recent = make(tmp_path, "gguf", "recent-2", 0.5)
    busy = make(tmp_path, "tokenizers", "busy-3", 10)
    kernels = make(tmp_path, "cpu_kernels", "avx2", 30)
    assert [e.path.name for e in entries(tmp_path)] == ["avx2", "old-1", "busy-3", "recent-2"]  # oldest first
    assert entries(tmp_path)[1].size == 1000
    with open(tmp_path / "tokenizers" / "busy-3.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process making it
        assert [e.path for e in prune(tmp_path, 7, dry_run=True)] == [old]
        assert old.is_dir(), "a dry run removes nothing"
        assert [e.path for e in prune(tmp_path, 7)] == [old]
    assert not old.exists() and not (tmp_path / "gguf" / "old-1.lock").exists()
    assert recent.is_dir() and busy.is_dir() and kernels.is_dir()
    assert [e.path for e in prune(tmp_path, 0)] == [busy, recent]  # 0 days: everything not in use
    with pytest.raises(ValueError, match="--unused-for must be >= 0"):
        prune(tmp_path, -1)


def test_a_use_marks_the_entry(tmp_path):
    entry = make(tmp_path, "gguf", "m-4", 10)
    mark_used(entry)
    assert prune(tmp_path, 1) == [] and entry.is_dir()


def test_the_command_lists_and_prunes(tmp_path, capsys):
    make(tmp_path, "gguf", "old-5", 10, size=2_000_000)
    assert main(["cache", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gguf" in out and "2.0 MB" in out and "10.0 days ago" in out and "old-5" in out
    assert main(["cache", "--root", str(tmp_path), "prune", "--unused-for", "7"]) == 0
    assert "removed gguf/old-5 (2.0 MB" in capsys.readouterr().out
    assert main(["cache", "--root", str(tmp_path)]) == 0 and "empty" in capsys.readouterr().out
