"""What the fuzz tier's tests share: the checks a fleet must pass after any input.

- `assert_openai_error(status, body)`: a 4xx body in OpenAI's error shape
  ({"error": {"message": str, "type": str, "param": ..., "code": ...}}); returns the error object.
- `assert_alive(fleet)`: no process of the fleet (Redis, workers, gateways) has exited.
- `requests_placed(fleet)`: how many requests the gateway has enqueued (a rejected one must not add to it).
- `assert_serves(fleet)`: a good completion and a good streamed chat still work, through the `openai` client.
- `revive(fleet)`: starts again a worker that died (same id), so one crash shows in one test, not in every
  test after it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
from fleet_harness import API_KEY, Fleet

ERROR_KEYS = {"message", "type", "param", "code"}
WORKER_FLAGS = ("--num-kv-blocks", "256", "--max-num-seqs", "16")  # room for the fuzzer's batches


def processes(fleet: Fleet) -> dict[str, subprocess.Popen]:
    procs: dict[str, subprocess.Popen] = {"redis": fleet.redis.proc}
    procs.update({f"worker {wid}": p for wid, p in fleet.workers.items()})
    procs.update({f"gateway :{port}": p for port, p in fleet.gateways.items()})
    return procs


def assert_alive(fleet: Fleet) -> None:
    dead = {name: p.returncode for name, p in processes(fleet).items() if p.poll() is not None}
    assert not dead, f"fleet processes exited (name: exit code): {dead}\n{fleet.tail()}"


def assert_openai_error(status: int, body: bytes | str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        raise AssertionError(f"HTTP {status}: the body is not JSON: {body[:300]!r}") from None
    assert isinstance(doc, dict) and set(doc) == {"error"}, f"HTTP {status}: not OpenAI's error shape: {doc!r}"
    err = doc["error"]
    assert isinstance(err, dict) and set(err) == ERROR_KEYS, f"HTTP {status}: error keys {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"HTTP {status}: empty message: {err!r}"
    assert isinstance(err["type"], str) and err["type"], f"HTTP {status}: no type: {err!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"HTTP {status}: param {err['param']!r}"
    assert err["code"] is None or isinstance(err["code"], str | int), f"HTTP {status}: code {err['code']!r}"
    return err


def assert_serves(fleet: Fleet) -> None:
    client = fleet.client(timeout=60)
    done = client.completions.create(model=fleet.model, prompt="The capital of France is", max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    events = list(client.chat.completions.create(model=fleet.model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert events and events[-1].choices[0].finish_reason == "length"


def requests_placed(fleet: Fleet) -> float:
    """Requests the gateway has put into the fleet's streams (its `kvfleet_routing_decisions_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(fleet.url() + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)\
        .raise_for_status().text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "kvfleet_routing_decisions"
               for s in fam.samples if s.name.endswith("_total"))


def vocab_size(fleet: Fleet) -> int:
    return json.loads((Path(fleet.model) / "config.json").read_text())["vocab_size"]


def revive(fleet: Fleet) -> None:
    dead = [wid for wid, p in fleet.workers.items() if p.poll() is not None]
    for wid in dead:
        fleet.start_worker(wid, *WORKER_FLAGS)
    if dead:
        fleet.wait_ready(workers=len(fleet.workers))


def start_fleet(fleet: Fleet) -> Fleet:
    """One worker on the tiny model and one gateway with the test API key, reading "auto" tool calls (hermes)."""
    fleet.start_worker("w0", *WORKER_FLAGS)
    fleet.start_gateway("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", "chatml-tools")
    fleet.wait_ready(workers=1)
    return fleet
