"""The Celery worker survives its broker going away while a task runs (services.celery_transport): Redis is
SIGKILLed and started again on the same AOF while an acks_late task is in progress. kombu's own Redis
transport makes the worker exit there ("Unrecoverable error: AttributeError: 'NoneType' object has no
attribute 'hostname'"); with kvfleet's configuration the worker reconnects, the task finishes and its result
is read, and the next task runs. So does a task that starts just as Redis dies (services.celery_app retries its
result backend). A real Redis, a real `celery worker` process on an app configured by
services.celery_app.configure, no fleet (the task only sleeps)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from celery import Celery
from fleet_harness import REPO, wait_for

from services.celery_app import configure
from services.redis_server import RedisServer
from shared.settings import Settings, child_env

pytestmark = pytest.mark.integration

APP = '''
import os
import signal
import time

from celery import Celery, signals

from services.celery_app import configure
from shared.settings import Settings

app = Celery("broker-loss")
configure(app, Settings.from_env())


@app.task(name="sleepy")
def sleepy(seconds):
    time.sleep(seconds)
    return seconds


@app.task(name="starts_in_an_outage")
def starts_in_an_outage(seconds):
    time.sleep(seconds)
    return seconds


@signals.task_prerun.connect
def _kill_redis_as_it_starts(task=None, **_):
    # The fault at the one moment a timed SIGKILL rarely hits: after the task is received, before its STARTED
    # state is stored (the prerun signal comes first).
    if task.name == "starts_in_an_outage":
        os.kill(int(os.environ["BROKER_LOSS_REDIS_PID"]), signal.SIGKILL)
'''


class _Fleetless:
    """A Redis on its own AOF and a `celery worker` (2 threads) on APP; the log is the worker's output."""

    def __init__(self, tmp_path):
        (tmp_path / "broker_loss_app.py").write_text(APP)
        self.redis = RedisServer(password="pw", data_dir=str(tmp_path / "redis-data"))
        self.redis.start()
        self.log = tmp_path / "celery.log"
        env = child_env(KVFLEET_REDIS_URL=self.redis.url, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}",
                        BROKER_LOSS_REDIS_PID=str(self.redis.proc.pid))
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "broker_loss_app", "worker",
                                          "--pool=threads", "-c", "2", "--loglevel=INFO", "--without-gossip",
                                          "--without-mingle", "--without-heartbeat"],
                                         cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
        wait_for(lambda: "ready." in self.log.read_text(), 120, "the Celery worker", self.log)
        self.client = Celery("broker-loss-client")
        configure(self.client, Settings(redis_url=self.redis.url))

    def restart_redis_once_dead(self):
        """Waits for the SIGKILLed Redis to exit, then starts it again on the same port and AOF after 1 s."""
        self.redis.proc.wait()
        self.redis.proc = None
        time.sleep(1)
        self.redis.start()

    def assert_the_worker_came_through(self, res, expected):
        wait_for(lambda: self.proc.poll() is not None or res.ready(), 60, "the task's result, or the worker's exit",
                 self.log)
        assert self.proc.poll() is None and "Unrecoverable error" not in self.log.read_text(), \
            self.log.read_text()[-3000:]
        assert res.get(timeout=10) == expected
        assert self.client.send_task("sleepy", args=[0]).get(timeout=60) == 0

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.redis.stop()


def test_celery_worker_survives_a_redis_restart_while_a_task_runs(tmp_path):
    fleetless = _Fleetless(tmp_path)
    try:
        res = fleetless.client.send_task("sleepy", args=[6])
        wait_for(lambda: f"sleepy[{res.id}] received" in fleetless.log.read_text(), 60, "the task to start")
        os.kill(fleetless.redis.proc.pid, signal.SIGKILL)
        fleetless.restart_redis_once_dead()
        fleetless.assert_the_worker_came_through(res, 6)
    finally:
        fleetless.stop()


def test_a_task_that_starts_as_redis_dies_runs_once_redis_is_back(tmp_path):
    """Redis is SIGKILLed between the task's receipt and the store of its STARTED state (the app's prerun
    handler sends the signal). Celery's default fails the task "outside body" there: it never runs, and its
    message waits out the visibility timeout (an hour). CI hit this timing in the test above twice."""
    fleetless = _Fleetless(tmp_path)
    try:
        res = fleetless.client.send_task("starts_in_an_outage", args=[1])
        fleetless.restart_redis_once_dead()
        fleetless.assert_the_worker_came_through(res, 1)
        assert "Exception raised outside body" not in fleetless.log.read_text()
    finally:
        fleetless.stop()
