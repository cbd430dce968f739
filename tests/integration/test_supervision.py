"""`kvfleet up` supervises its children: a worker killed with SIGKILL is started again with the same id (the
launcher says why it ended), the fleet keeps serving through the gateway meanwhile and after, the worker's
status counts the restart (`kvfleet status` shows it); a killed gateway comes back too. SIGTERM then stops
everything, leaving nothing running."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from services import status_cmd
from services.ports import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-supervised"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Up:
    """A `kvfleet up` process with its output in a file."""

    def __init__(self, model: Path, log: Path, workers: int = 2):
        self.port, self.log, self.model = free_port(), log, str(model)
        env = dict(os.environ, HF_HUB_OFFLINE="1", KVFLEET_STATUS_TTL_S="2", KVFLEET_HEARTBEAT_S="0.5")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--workers", str(workers), "--port", str(self.port),
                 "--model", self.model, "--num-kv-blocks", "64", "--max-num-seqs", "8", "--api-key", KEY,
                 "--drain-timeout", "5", "--data-dir", str(log.parent / "redis")],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url_file = log.parent / "redis" / "redis-url"  # the private Redis's full URL (its password), 0600

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, what: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvfleet up exited while waiting for {what}\n{self.text()[-4000:]}"
            try:
                value = predicate()
            except httpx.HTTPError:
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.text()[-4000:]}")

    def workers(self) -> dict[str, dict]:
        r = httpx.get(self.base + "/v1/fleet", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        return {w["worker_id"]: w for w in r.raise_for_status().json()["workers"]}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


class Load(threading.Thread):
    """Completions one after another through the gateway, counting what was served and what failed."""

    def __init__(self, up: Up, i: int):
        super().__init__(daemon=True)
        self.up, self.i = up, i
        self.served, self.errors, self.stopped = 0, [], threading.Event()

    def run(self) -> None:
        client = self.up.client()
        n = 0
        while not self.stopped.is_set():
            n += 1
            try:
                done = client.completions.create(model=self.up.model, prompt=f"load {self.i} request {n}",
                                                 max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
                assert done.usage.completion_tokens == 4
                self.served += 1
            except Exception as e:  # noqa: BLE001 (reported by the test)
                self.errors.append(repr(e))


def test_killed_worker_and_gateway_come_back(tiny_llama_dir, tmp_path, capsys):
    up = Up(tiny_llama_dir, tmp_path / "up.log")
    seen_pids: set[int] = set()
    try:
        up.wait_for(lambda: "kvfleet: ready" in up.text(), "the fleet to come up", timeout_s=180)
        redis_pid = int(re.search(r"private Redis at (\S+) \(pid (\d+)\)", up.text()).group(2))
        redis_url = up.url_file.read_text().strip()
        assert "private Redis at redis://:***@" in up.text() and redis_url.split("@")[0] not in up.text()
        gateway_pid = int(re.search(r"starting gateway \(pid (\d+)\)", up.text()).group(1))
        workers = up.wait_for(lambda: len(w := up.workers()) == 2 and w, "both workers")
        assert sorted(workers) == ["w0", "w1"] and {w["restarts"] for w in workers.values()} == {0}
        victim = workers["w1"]["pid"]
        seen_pids |= {redis_pid, gateway_pid, victim, workers["w0"]["pid"]}

        loads = [Load(up, i) for i in range(4)]
        for t in loads:
            t.start()
        up.wait_for(lambda: all(t.served for t in loads), "the load to get going")
        os.kill(victim, signal.SIGKILL)
        served_at_kill = sum(t.served for t in loads)
        up.wait_for(lambda: f"w1 (pid {victim}) killed by SIGKILL; starting it again in 1s" in up.text(),
                    "the launcher to say why w1 ended")
        back = up.wait_for(lambda: (w := up.workers().get("w1")) and w["pid"] != victim and w, "w1 to come back")
        assert back["restarts"] == 1 and up.workers()["w0"]["restarts"] == 0
        assert f"w1 started again as pid {back['pid']} (restart 1)" in up.text()
        seen_pids.add(back["pid"])
        served_when_back = sum(t.served for t in loads)
        assert served_when_back > served_at_kill, "nothing was served while w1 was down"
        up.wait_for(lambda: sum(t.served for t in loads) >= served_when_back + 8, "requests after w1's return")
        for t in loads:
            t.stopped.set()
        for t in loads:
            t.join(90)
        errors = [e for t in loads for e in t.errors]
        assert not errors, f"{errors[:3]}\n{up.text()[-3000:]}"

        # `kvfleet status` reads the same Redis: w1's row shows one restart
        capsys.readouterr()
        assert status_cmd.run(argparse.Namespace(redis_url=redis_url, json=False)) == 0
        out = capsys.readouterr().out
        header, *rows = out.splitlines()
        at = header.index("RESTARTS")
        restarts = {row.split()[0]: row[at:at + len("RESTARTS")].strip() for row in rows if row[:2] in ("w0", "w1")}
        assert restarts == {"w0": "0", "w1": "1"}, out

        os.kill(gateway_pid, signal.SIGKILL)
        up.wait_for(lambda: f"gateway (pid {gateway_pid}) killed by SIGKILL" in up.text(),
                    "the launcher to say why the gateway ended")
        new_gateway = int(up.wait_for(lambda: re.search(r"gateway started again as pid (\d+)", up.text()),
                                      "the gateway to start again").group(1))
        seen_pids.add(new_gateway)
        up.wait_for(lambda: httpx.get(up.base + "/health", timeout=2).status_code == 200, "the gateway's /health")
        done = up.client().completions.create(model=up.model, prompt="after the gateway's return", max_tokens=4,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        assert up.proc.poll() is None
    finally:
        if up.proc.poll() is None:
            os.kill(up.proc.pid, signal.SIGTERM)
        up.proc.wait(90)
    assert up.proc.returncode == 0, up.text()[-3000:]
    assert "kvfleet: stopped" in up.text()
    assert not [p for p in seen_pids if _alive(p)], "children left running"


@pytest.mark.slow
def test_crash_loop_stays_down_and_redis_is_restarted(tiny_llama_dir, tmp_path):
    """w0 killed each time it starts: after 5 restarts within a minute it stays down, said so, and the launcher
    keeps running. The private Redis killed: started again on its port with its data. Killed each time it comes
    back: past 5 restarts within a minute the fleet stops (exit 1) with the reason, leaving nothing running."""
    up = Up(tiny_llama_dir, tmp_path / "up.log", workers=1)
    pids: set[int] = set()
    try:
        up.wait_for(lambda: "kvfleet: ready" in up.text(), "the fleet to come up", timeout_s=180)
        pids.add(int(re.search(r"starting gateway \(pid (\d+)\) and 1 worker\(s\) \((\d+)\)", up.text()).group(1)))
        pid = int(re.search(r"starting gateway \(pid \d+\) and 1 worker\(s\) \((\d+)\)", up.text()).group(1))
        for restart in range(1, 6):
            os.kill(pid, signal.SIGKILL)
            pids.add(pid)
            pid = int(up.wait_for(lambda n=restart: re.search(rf"w0 started again as pid (\d+) \(restart {n}\)",
                                                               up.text()), f"restart {restart}").group(1))
        os.kill(pid, signal.SIGKILL)
        pids.add(pid)
        up.wait_for(lambda: "w0 is in a crash loop: started again 5 times within 60s" in up.text(), "the crash loop")
        assert "It stays down" in up.text() and "restart 6" not in up.text()
        assert up.proc.poll() is None

        redis_pid, port = (int(x) for x in re.search(r"private Redis at redis://:\*\*\*@127.0.0.1:(\d+)/0 "
                                                     r"\(pid (\d+)\)", up.text()).group(2, 1))
        for restart in range(1, 6):
            os.kill(redis_pid, signal.SIGKILL)
            pids.add(redis_pid)
            again = up.wait_for(lambda n=restart: len(found := re.findall(
                rf"private Redis running again at redis://:\*\*\*@127.0.0.1:{port}/0 \(pid (\d+)\)", up.text())) >= n
                and found[n - 1], f"Redis restart {restart}")
            assert f"the private Redis (pid {redis_pid}) killed by SIGKILL; starting it again on port {port}" in up.text()
            redis_pid = int(again)
        os.kill(redis_pid, signal.SIGKILL)
        pids.add(redis_pid)
        up.proc.wait(60)
    finally:
        if up.proc.poll() is None:
            os.kill(up.proc.pid, signal.SIGTERM)
            up.proc.wait(90)
    assert up.proc.returncode == 1, up.text()[-3000:]
    assert "5 times within 60s of its restarts; stopping the fleet" in up.text()
    assert "kvfleet: stopped" in up.text()
    assert not [p for p in pids if _alive(p)], "processes left running"


def test_a_child_that_dies_while_the_fleet_starts_stops_it_with_the_reason(tmp_path):
    """A configuration error (here: no such model) is not restarted: the start fails at once, saying which
    child ended and the end of its stderr."""
    up = Up(tmp_path / "no-such-model", tmp_path / "up.log", workers=1)
    assert up.proc.wait(120) == 1, up.text()[-3000:]
    # the gateway ends with the traceback (code 1), the worker with one line naming the setting (code 2)
    assert re.search(r"kvfleet: the fleet did not come up: (gateway|w0) \(pid \d+\) exited with code [12]; the end "
                     r"of its stderr:\n(    .*\n)*    .*(ModelNotFound: |kvfleet worker cannot start: )model "
                     r"'.*no-such-model' not found", up.text())
    assert "started again" not in up.text() and "kvfleet: stopped" in up.text()
