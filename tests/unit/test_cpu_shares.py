"""How `kvfleet up` shares the CPUs among its workers (services.launcher.cpu_shares) and the worker's --cpus
list (gpu_worker.serve.worker_cmd), with the process's CPU affinity faked (one module each)."""

from __future__ import annotations

import argparse

import pytest

from gpu_worker.serve import worker_cmd
from services import launcher

pytestmark = pytest.mark.unit


def shares(monkeypatch, cores: int, workers: int, **kw) -> list[list[str]]:
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    return launcher.cpu_shares(argparse.Namespace(workers=workers, **kw))


def test_each_cpu_worker_gets_its_own_cores(monkeypatch):
    assert shares(monkeypatch, 2, 2) == [["--cpus", "0", "--threads", "1"], ["--cpus", "1", "--threads", "1"]]
    assert shares(monkeypatch, 8, 3) == [["--cpus", "0,1", "--threads", "2"], ["--cpus", "2,3", "--threads", "2"],
                                         ["--cpus", "4,5", "--threads", "2"]]


def test_more_workers_than_cores_get_one_thread_each_unpinned(monkeypatch):
    assert shares(monkeypatch, 2, 3) == [["--threads", "1"]] * 3


def test_one_worker_gpu_workers_and_simulated_workers_are_left_alone(monkeypatch):
    assert shares(monkeypatch, 8, 1) == [[]]
    assert shares(monkeypatch, 8, 2, device="cuda") == [[], []]
    assert shares(monkeypatch, 8, 2, simulate="smollm2-cpu") == [[], []]


def test_cpu_lists_parse_and_must_be_allowed(monkeypatch):
    monkeypatch.setattr(worker_cmd.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert worker_cmd.cpu_list("0-1,3") == [0, 1, 3]
    for bad in ("7", "a-b", "2-", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--cpus"):
            worker_cmd.cpu_list(bad)


def test_worker_cpus_confine_the_workers_even_one(monkeypatch):
    assert shares(monkeypatch, 4, 1, worker_cpus=[1, 2, 3]) == [["--cpus", "1,2,3", "--threads", "3"]]
    assert shares(monkeypatch, 4, 2, worker_cpus=[2, 3]) == [["--cpus", "2", "--threads", "1"],
                                                               ["--cpus", "3", "--threads", "1"]]
