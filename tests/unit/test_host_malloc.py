"""gpu_worker.executor.host_malloc: glibc told to keep freed memory, other C libraries left alone. What it saves
(page faults per decode step) is measured in tests/e2e/test_step_page_faults.py."""

import logging
import os

import pytest

from gpu_worker.executor import host_malloc


def test_glibc_keeps_freed_memory():
    assert host_malloc.keep_freed_memory() == host_malloc.KEPT  # the image and CI run glibc
    assert host_malloc.keep_freed_memory() is host_malloc.keep_freed_memory()  # once per process


def test_another_c_library_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(host_malloc.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_malloc._apply() == "musl's malloc, as it is"
    monkeypatch.setattr(host_malloc.platform, "libc_ver", lambda: ("", ""))
    assert host_malloc._apply() == "the C library's malloc, as it is"


def test_a_refused_setting_is_said(monkeypatch, caplog):
    class Libc:
        def __init__(self):
            self.calls = []

        def mallopt(self, param, value):
            self.calls.append((param, value))
            return 0 if param == host_malloc.M_TRIM_THRESHOLD else 1

    libc = Libc()
    monkeypatch.setattr(host_malloc.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(host_malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))
    with caplog.at_level(logging.WARNING, logger=host_malloc.__name__):
        assert host_malloc._apply() == "glibc malloc, default thresholds (mallopt failed)"
    assert "could not set glibc's malloc thresholds" in caplog.text
    assert libc.calls[:2] == [(host_malloc.M_MMAP_THRESHOLD, 32 << 20), (host_malloc.M_TRIM_THRESHOLD, 1 << 30)]


@pytest.mark.parametrize("param, value", host_malloc.SETTINGS)
def test_settings_fit_mallopt(param, value):
    assert param in (-1, -2, -3) and 0 < value < 2**31  # mallopt takes a C int


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_memory_goes_back_only_when_released():
    """Under the kept thresholds, 192 MiB of freed tensors (below the mmap threshold: from the heaps) stay
    resident; release_freed hands them back, as the model runner does once the loaded weights no path reads are
    freed."""
    import torch

    assert host_malloc.keep_freed_memory() == host_malloc.KEPT
    chunks = [torch.ones(1 << 20) for _ in range(48)]  # 4 MiB each
    before_free = _resident_bytes()
    del chunks
    kept = _resident_bytes()
    assert before_free - kept < 32 << 20  # kept by the heaps
    assert host_malloc.release_freed()
    assert kept - _resident_bytes() > 128 << 20


def test_release_freed_leaves_another_c_library_alone(monkeypatch):
    monkeypatch.setattr(host_malloc.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_malloc.release_freed() is False
