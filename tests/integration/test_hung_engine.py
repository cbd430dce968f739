"""A hung engine: an engine step that never returns, in a real worker process (tests/fault_worker.py, HANG_SEED:
the model runner's forward never comes back while that request is in the batch). The worker's writer thread
keeps heartbeating, so neither the router nor the other workers would ever notice. Its watchdog
(gpu_worker.serve.watchdog) does, past KVFLEET_ENGINE_STALL_S: it logs where the main thread is stuck, removes the
worker's status and exits 1. The requests it held, the one that hung it and the one that shared its batch, are
taken over by another worker and finished; the innocent one's greedy answer is the one an undisturbed run gives."""

from __future__ import annotations

import time

import pytest
from fault_worker import HANG_SEED
from fleet_harness import Fleet

from services.client import FleetClient
from shared import keys, streams
from shared.settings import Settings

pytestmark = pytest.mark.integration

STALL_S = 4.0
PROMPT = "Once upon a time, in a land of many rivers,"


def test_a_hung_engine_is_noticed_its_worker_exits_and_its_requests_are_finished_elsewhere(tiny_llama_dir, tmp_path):
    env = {"KVFLEET_HEARTBEAT_S": "0.5", "KVFLEET_STATUS_TTL_S": "3", "KVFLEET_ENGINE_STALL_S": str(STALL_S)}
    with Fleet(tiny_llama_dir, tmp_path, env=env) as fleet:
        r = streams.connect(fleet.redis.url)
        hung = fleet.start_worker("w-hang", "--num-kv-blocks", "128", script="fault_worker.py")
        fleet.wait_for(lambda: r.get(keys.status("w-hang")), timeout_s=120, what="w-hang to register")
        settings = Settings.from_env(redis_url=fleet.redis.url)
        with FleetClient(settings=settings) as client:
            innocent = client.submit(PROMPT, max_tokens=40, temperature=0, ignore_eos=True)
            culprit = client.submit(PROMPT, max_tokens=20, temperature=0.8, seed=HANG_SEED, ignore_eos=True)
            sent = time.monotonic()
            assert hung.wait(timeout=60) == 1, fleet.tail()
            exited_after = time.monotonic() - sent
            log = fleet.logs["w-hang"].read_text(errors="replace")
            assert "w-hang is hung: its main loop has not come round for" in log, fleet.tail()
            assert "execute_hook" in log  # where the main thread was stuck: the forward that never returned
            assert exited_after < STALL_S + 15, f"exited {exited_after:.1f}s after the requests came"
            assert r.get(keys.status("w-hang")) is None  # removed at once, not left to expire

            fleet.start_worker("w-ok", "--num-kv-blocks", "128")
            answer = innocent.result(timeout=120)
            assert culprit.result(timeout=120)["choices"][0]["finish_reason"] == "length"
            again = client.submit(PROMPT, max_tokens=40, temperature=0, ignore_eos=True).result(timeout=60)
        assert answer["choices"][0]["text"] == again["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] == 40
        assert "left pending by w-hang" in fleet.logs["w-ok"].read_text(errors="replace"), fleet.tail()
        r.close()
