"""One soak: start the fleet, compute the fault-free reference (every catalogue request once, not streamed),
then run the mixed load for `duration_s` while the injector injects faults (client threads, each request
through a door of load.MODES, and a batch thread that runs small batch files), let it drain, and check
(services.chaos.report)."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.chaos import jobs, load
from services.chaos.faults import KINDS, Injector
from services.chaos.fleet import JOB_TTL_S, ChaosFleet
from services.chaos.report import Report, check
from services.client import FleetClient
from shared import streams
from shared.settings import Settings

MEMORY_SETTLE_S = 90.0  # after the load: how long Redis memory may take to come back to its baseline (job TTL)
IDLE_WAIT_S = 60.0  # after the load: how long the workers may take to end what nobody waits for (cancels)
BATCH_EVERY_S = (3.0, 10.0)  # pause before each batch file
COVER_TIMEOUT_S = 300.0  # past the duration, the load goes on until every fault kind was injected, at most this long


@dataclass(frozen=True)
class SoakConfig:
    model: str
    duration_s: float
    seed: int
    work_dir: Path
    clients: int = 6
    kinds: tuple[str, ...] = KINDS
    interval_s: tuple[float, float] = (3.0, 6.0)
    progress_every_s: float = 10.0


def _reference(fleet: ChaosFleet, specs: list[load.Spec]) -> list[list[str]]:
    import openai

    client = openai.OpenAI(base_url=fleet.url(fleet.ports[0]) + "/v1", api_key=fleet.api_key, max_retries=0,
                           timeout=load.CLIENT_TIMEOUT_S)
    ref = []
    for spec in specs:
        whole = dataclasses.replace(spec, stream=False)
        rec = load.send(client, [whole], 0, "whole", fleet.model, fleet.ports[0], random.Random(0))
        if rec.outcome != "ok":
            raise RuntimeError(f"the fault-free reference failed ({rec.outcome} {rec.status} {rec.code}) for {spec}")
        ref.append(rec.texts)
    return ref


def _memory(fleet: ChaosFleet) -> int:
    r = streams.connect(fleet.redis.url)
    try:
        return streams.used_memory(r, keys_only=True)
    finally:
        r.close()


@dataclass
class Doors:
    """What the load threads share: the Python client (one for every thread: its tokenizer loads once;
    FleetClients loading theirs in parallel threads of one process race on transformers' lazy import) and
    the Celery client app."""

    direct: FleetClient
    celery: jobs.CeleryDoor


def _client_loop(fleet: ChaosFleet, specs: list[load.Spec], injector: Injector, seed: int, done: threading.Event,
                 records: list[load.Record], doors: Doors) -> None:
    import openai

    rng = random.Random(seed)
    clients = {p: openai.OpenAI(base_url=fleet.url(p) + "/v1", api_key=fleet.api_key, max_retries=0,
                                timeout=load.CLIENT_TIMEOUT_S) for p in fleet.ports}
    while not done.is_set():
        port = rng.choice(fleet.ports)
        if injector.take_poison():
            records.append(load.send_poison(fleet.url(port), fleet.api_key, fleet.model, port, rng))
            continue
        idx, mode = rng.randrange(len(specs)), rng.choice(load.MODES)
        try:
            if mode in ("python_client", "python_cancel"):
                rec = jobs.send_python(doors.direct, specs, idx, fleet.model, rng, cancel=mode == "python_cancel")
            elif mode == "celery":
                rec = doors.celery.send(specs, idx, fleet.model, injector.log)
            else:
                rec = load.send(clients[port], specs, idx, mode, fleet.model, port, rng)
        except Exception as e:  # noqa: BLE001 (an error no client should meet: recorded, checked, the load goes on)
            rec = load.Record(spec=idx, mode=mode, port=port, t0=time.time(), t1=time.time(),
                              outcome="client_exception", detail=repr(e))
        records.append(rec)
        if rec.outcome == "refused":
            time.sleep(0.2)  # a gateway restarting, Redis away: do not spin
    while injector.take_poison():  # a poison fault just before the end is still sent
        port = rng.choice(fleet.ports)
        records.append(load.send_poison(fleet.url(port), fleet.api_key, fleet.model, port, rng))


def _batch_loop(fleet: ChaosFleet, specs: list[load.Spec], seed: int, done: threading.Event,
                records: list[load.Record]) -> None:
    """A small batch file (jobs.BATCH_LINES catalogue requests) every few seconds while the load lasts."""
    rng = random.Random(seed)
    k = 0
    while not done.wait(rng.uniform(*BATCH_EVERY_S)):
        idxs = [rng.randrange(len(specs)) for _ in range(jobs.BATCH_LINES)]
        try:
            records.extend(jobs.run_batch(fleet.env, fleet.work_dir, k, specs, idxs, fleet.model))
        except Exception as e:  # noqa: BLE001 (recorded, checked, the load goes on)
            records.append(load.Record(spec=idxs[0], mode="batch", port=0, t0=time.time(), t1=time.time(),
                                       outcome="client_exception", detail=repr(e)))
        k += 1


def _wait_idle(fleet: ChaosFleet) -> dict[str, int]:
    """Until no worker runs or holds a request (the load is over: what is left is work nobody waits for)."""
    deadline, busy = time.time() + IDLE_WAIT_S, fleet.busy()
    while time.time() < deadline and any(busy.values()):
        time.sleep(1)
        busy = fleet.busy()
    return {w: n for w, n in busy.items() if n}


def _save(work_dir: Path, records: list[load.Record], injector: Injector) -> None:
    """records.jsonl (one request a line) and faults.jsonl, next to the logs, for a look after the run."""
    with open(work_dir / "records.jsonl", "w") as f:
        f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
    with open(work_dir / "faults.jsonl", "w") as f:
        f.writelines(json.dumps({"t": t, "kind": k, "target": tg}) + "\n" for t, k, tg in injector.log.events)


def run_soak(cfg: SoakConfig, say: Callable[[str], None] = print) -> Report:
    fleet = ChaosFleet(cfg.model, cfg.work_dir)
    say(f"starting the fleet (Redis with AOF, {len(fleet.workers)} workers, {len(fleet.ports)} gateways); "
        f"logs in {cfg.work_dir}")
    closing: list = []
    try:
        fleet.start()
        specs = load.catalogue(cfg.seed)
        reference = _reference(fleet, specs)
        time.sleep(3)  # the reference's outputs expire (2 s after read)
        baseline = _memory(fleet)
        say(f"reference: {len(specs)} requests, fault-free; Redis baseline {baseline / 2**20:.1f} MiB; "
            f"soaking for {cfg.duration_s:g}s with seed {cfg.seed}")
        injector = Injector(fleet, cfg.seed, cfg.kinds, cfg.interval_s)
        records: list[load.Record] = []
        start = time.time()
        until, done = start + cfg.duration_s, threading.Event()
        direct = FleetClient(settings=Settings.from_env(redis_url=fleet.redis.url, output_ttl_s=30.0,
                                                        job_ttl_s=JOB_TTL_S, request_timeout_s=load.CLIENT_TIMEOUT_S))
        closing.append(direct)
        doors = Doors(direct, jobs.CeleryDoor(fleet.redis.url))
        threads = [threading.Thread(target=_client_loop, daemon=True,
                                    args=(fleet, specs, injector, cfg.seed * 1000 + i, done, records, doors))
                   for i in range(cfg.clients)]
        threads.append(threading.Thread(target=_batch_loop, daemon=True,
                                        args=(fleet, specs, cfg.seed * 1000 + cfg.clients, done, records)))
        injector.start()
        for t in threads:
            t.start()
        next_progress = start + cfg.progress_every_s
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            now = time.time()
            if now >= next_progress:
                next_progress += cfg.progress_every_s
                ok = sum(r.outcome == "ok" for r in records)
                say(f"[{now - start:5.0f}/{cfg.duration_s:g}s] requests {len(records)} "
                    f"(ok {ok}), faults {sum(injector.log.counts.values())}: {dict(injector.log.counts)}")
            covered = set(injector.log.counts) >= set(cfg.kinds) or now > until + COVER_TIMEOUT_S
            if now > until and covered:  # every kind at least once (a slow machine restarts workers slowly)
                done.set()
                injector.stop()  # no fault while the load drains
        injector.stop()
        say("load drained; waiting for every process, for the workers to go idle and for Redis memory to settle")
        try:
            fleet.wait_ready(120)
        except RuntimeError as e:
            say(str(e))
        lingering = _wait_idle(fleet)
        deadline, memory = time.time() + MEMORY_SETTLE_S, _memory(fleet)
        while time.time() < deadline and memory > Report.memory_limit(baseline):
            time.sleep(1)
            memory = _memory(fleet)
        _save(cfg.work_dir, records, injector)
        return check(specs, reference, records, injector.log, fleet, baseline, memory, lingering)
    finally:
        for client in closing:
            client.close()
        fleet.stop()
