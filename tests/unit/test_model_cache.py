"""shared.models: where what is derived from a model once (a GGUF's de-quantized copy, its tokenizer) is kept, and
under which name: the GGUF's content decides it, not its path or mtime (a fresh venv finds the copy made already)."""

from __future__ import annotations

import os

import pytest

from shared.models import SAMPLE_BYTES, cache_dir, gguf_cache_name

pytestmark = pytest.mark.unit


def _gguf(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_same_content_anywhere_has_one_name_and_a_change_another(tmp_path):
    data = bytes(range(256)) * (SAMPLE_BYTES // 16)  # 1 MiB: every sampled piece overlaps another
    a = _gguf(tmp_path / "venv-a" / "model.gguf", data)
    b = _gguf(tmp_path / "venv-b" / "model.gguf", data)
    os.utime(b, (1, 1))  # installed at another time
    assert gguf_cache_name(a) == gguf_cache_name(b) and gguf_cache_name(a).startswith("model-")
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    assert gguf_cache_name(_gguf(tmp_path / "c" / "model.gguf", bytes(changed))) != gguf_cache_name(a)
    assert gguf_cache_name(_gguf(tmp_path / "d" / "model.gguf", data + b"\0")) != gguf_cache_name(a)
    assert gguf_cache_name(_gguf(tmp_path / "e" / "tiny.gguf", b"GGUF")).startswith("tiny-")  # under one piece


def test_the_cache_is_under_home_and_falls_back_to_a_temp_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("tokenizers") == tmp_path / "home" / ".cache" / "kvfleet" / "tokenizers"
    assert cache_dir("tokenizers").is_dir()
    assert cache_dir("gguf", tmp_path / "elsewhere") == tmp_path / "elsewhere" / "gguf"
    (tmp_path / "not-a-dir").write_text("")  # a home no directory can be made under (even as root)
    monkeypatch.setenv("HOME", str(tmp_path / "not-a-dir"))
    fallback = cache_dir("gguf")
    assert fallback.is_dir() and fallback.parent.name == "kvfleet-cache" and fallback.name == "gguf"
