"""The Celery worker survives its broker going away while a task runs (services.celery_transport): Redis is
SIGKILLed and started again on the same AOF while an acks_late task is in progress. kombu's own Redis
transport makes the worker exit there ("Unrecoverable error: AttributeError: 'NoneType' object has no
attribute 'hostname'"); with kvfleet's configuration the worker reconnects, the task finishes and its result
is read, and the next task runs. A real Redis, a real `celery worker` process on an app configured by
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
import time

from celery import Celery

from services.celery_app import configure
from shared.settings import Settings

app = Celery("broker-loss")
configure(app, Settings.from_env())


@app.task(name="sleepy")
def sleepy(seconds):
    time.sleep(seconds)
    return seconds
'''


def test_celery_worker_survives_a_redis_restart_while_a_task_runs(tmp_path):
    (tmp_path / "broker_loss_app.py").write_text(APP)
    redis = RedisServer(password="pw", data_dir=str(tmp_path / "redis-data"))
    redis.start()
    log = tmp_path / "celery.log"
    env = child_env(KVFLEET_REDIS_URL=redis.url, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "broker_loss_app", "worker", "--pool=threads",
                                 "-c", "2", "--loglevel=INFO", "--without-gossip", "--without-mingle",
                                 "--without-heartbeat"], cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "ready." in log.read_text(), 120, "the Celery worker")
        client = Celery("broker-loss-client")
        configure(client, Settings(redis_url=redis.url))
        res = client.send_task("sleepy", args=[6])
        wait_for(lambda: f"sleepy[{res.id}] received" in log.read_text(), 60, "the task to start")
        os.kill(redis.proc.pid, signal.SIGKILL)
        redis.proc.wait()
        redis.proc = None
        time.sleep(1)
        redis.start()
        wait_for(lambda: proc.poll() is not None or res.ready(), 60, "the task's result, or the worker's exit")
        assert proc.poll() is None and "Unrecoverable error" not in log.read_text(), log.read_text()[-3000:]
        assert res.get(timeout=10) == 6
        assert client.send_task("sleepy", args=[0]).get(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        redis.stop()
