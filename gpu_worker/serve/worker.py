"""Run one engine worker that serves its Redis stream (`kvfleet worker`).

The engine runs in the main thread; two reader threads (gpu_worker.serve.intake) feed it Jobs and cancels
through a queue, and one writer thread (gpu_worker.serve.outbox) writes output chunks, acks and the status.
SIGTERM drains: take nothing new, hand back what has not started, finish the rest within --drain-timeout,
leave what is still unfinished pending (another worker claims it and continues), and exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import time
from collections import OrderedDict
from typing import Any

from gpu_worker.core.policies import policy_class
from gpu_worker.serve.intake import Cancel, Intake, Room, requeue
from gpu_worker.serve.metrics import WorkerMetrics
from gpu_worker.serve.outbox import Outbox
from gpu_worker.serve.request_telemetry import RequestTelemetry
from gpu_worker.serve.request_tracker import Job, RequestTracker
from shared import keys, streams, telemetry
from shared.messages import ChunkError, WorkerStatus
from shared.settings import Settings, hf_offline, redacted_url
from shared.streams import Ack

log = logging.getLogger("kvfleet.worker")


class Worker:
    def __init__(self, engine: Any, settings: Settings, *, model_name: str, model_path: str = "",
                 drain_timeout_s: float = 30.0, max_backlog: int | None = None):
        self.engine, self.settings = engine, settings
        self.worker_id = keys.validate_worker_id(settings.worker_id)
        self.model_name, self.model_path = model_name, model_path
        self.drain_timeout_s = drain_timeout_s
        self.max_backlog = max_backlog or 32
        self.tracker = RequestTracker(self.worker_id)
        self.inbox: queue.Queue = queue.Queue()
        self.cancelled: OrderedDict[str, None] = OrderedDict()  # cancels that came before their request
        self.taken: list[str] = []  # requests added since the last status: their reservations can go
        self.draining, self.drain_deadline, self.stopped = False, 0.0, False
        self._room = Room()
        self.num_finished = 0
        self.jobs_seen = 0  # jobs taken from the inbox (the intake compares it with the jobs it handed over)
        self.outbox: Outbox | None = None
        self.last_tick = time.monotonic()
        self.started_at = time.time()
        self.last_stats: Any = None  # the scheduler's stats at the last tick (metrics read it at scrape time)
        self.metrics = WorkerMetrics(model_name, self.worker_id, lambda: self.last_stats)
        self.telemetry = RequestTelemetry(self.worker_id, engine, self.metrics)
        self.status = self._status()

    # ---- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        r = streams.connect(self.settings.redis_url, health_check_interval=30)
        self.outbox = Outbox(r, self.settings, self.worker_id).start()
        self.outbox.set_status(self.status)
        self.intake = Intake(r, self.settings, self.worker_id, self.inbox, lambda: self._room,
                             metrics=self.metrics).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("worker %s serving %s on %s", self.worker_id, self.model_name, redacted_url(self.settings.redis_url))
        try:
            while not self.stopped:
                self.tick()
        finally:
            self.intake.stop()
            self.outbox.close()
        log.info("worker %s stopped", self.worker_id)
        return 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.draining:  # second signal: stop now
            self.drain_deadline = 0.0
            return
        log.info("signal %d: draining (up to %.0fs)", signum, self.drain_timeout_s)
        self.draining, self.drain_deadline = True, time.monotonic() + self.drain_timeout_s

    def tick(self) -> None:
        """One turn of the main loop: take what arrived, step the engine once, publish the status."""
        self.last_tick = time.monotonic()
        busy = self.engine.has_unfinished_requests()
        self._take_inbox(block_s=0.0 if busy else 0.05)
        if self.draining:
            self._drain_step()
        if self.engine.has_unfinished_requests() and not self.stopped:
            for output in self.engine.step():
                self._emit(output)
            self.telemetry.after_step()
        self.status = self._status()
        self._room = self._compute_room()
        self.outbox.set_status(self.status, self.taken)
        self.taken = []

    # ---- requests in ---------------------------------------------------------------------------
    def _take_inbox(self, block_s: float) -> None:
        try:
            item = self.inbox.get(timeout=block_s) if block_s else self.inbox.get_nowait()
            while True:
                if isinstance(item, Cancel):
                    self._cancel(item.request_id)
                elif self.draining:
                    self.jobs_seen += 1
                    self.outbox.hand_back(requeue(item.request), Ack(item.stream, item.entry_id))
                else:
                    self.jobs_seen += 1
                    self._add(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, job: Job) -> None:
        from gpu_worker.core.scheduler import RequestRejected

        rid = job.request_id
        if rid in self.tracker:  # the same request enqueued twice: its output stream is already being written
            log.warning("request %s is already running here; acking the duplicate entry", rid)
            self.outbox.send([], Ack(job.stream, job.entry_id))
            return
        self.tracker.add(job)
        self.telemetry.taken(job)
        if rid in self.cancelled:
            del self.cancelled[rid]
            self._close(job, finish_reason="abort")
            return
        req = job.request
        try:
            self.engine.add_request(
                rid, req.prompt_token_ids, req.params(), priority=req.priority, prompt=req.prompt,
                resume_output_token_ids=job.resume_token_ids(),
                arrival_time=time.monotonic() - max(0.0, time.time() - req.arrival_time))
        except (RequestRejected, ValueError) as e:
            if isinstance(e, RequestRejected) and job.stream != keys.req_stream(self.worker_id) \
                    and req.attempt + 1 < self.settings.max_deliveries:
                self.tracker.pop(rid)  # another worker may have the room this one lacks
                self.telemetry.ended(rid, f"handed back: {e}")
                self.outbox.hand_back(requeue(req), Ack(job.stream, job.entry_id))
                return
            self._close(job, error=ChunkError(kind="invalid_request", message=str(e)))
            return
        self.taken.append(rid)

    def _cancel(self, request_id: str) -> None:
        job = self.tracker.jobs.get(request_id)
        if job is None:
            self.cancelled[request_id] = None
            while len(self.cancelled) > 4096:
                self.cancelled.popitem(last=False)
            return
        self.engine.abort_request(request_id)
        self._close(job, finish_reason="abort")

    def _close(self, job: Job, **final: Any) -> None:
        self.tracker.pop(job.request_id)
        error = final.get("error")
        self.telemetry.ended(job.request_id, final.get("finish_reason") or "error",
                             error=error.message if error else None)
        self.outbox.send([self.tracker.final_chunk(job, **final)], Ack(job.stream, job.entry_id))

    # ---- output ------------------------------------------------------------------------------
    def _emit(self, output: Any) -> None:
        job = self.tracker.jobs.get(output.request_id)
        if job is None:
            return  # aborted meanwhile
        first = output.request_id not in self.tracker.started
        chunks = self.tracker.chunks_for(output)
        self.telemetry.output(job, output, chunks, first=first)
        if output.finished:
            self.num_finished += 1
            self.tracker.pop(job.request_id)
            self.outbox.send(chunks, Ack(job.stream, job.entry_id))
        elif chunks:
            self.outbox.send(chunks)

    # ---- drain -------------------------------------------------------------------------------
    def _drain_step(self) -> None:
        for rid, job in list(self.tracker.jobs.items()):  # not started yet: back to the fleet at once
            if rid not in self.tracker.started:
                self.engine.abort_request(rid)
                self.tracker.pop(rid)
                self.telemetry.ended(rid, "handed back (drain)")
                self.outbox.hand_back(requeue(job.request), Ack(job.stream, job.entry_id))
        if not self.tracker.jobs or time.monotonic() >= self.drain_deadline:
            for rid in list(self.tracker.jobs):  # unfinished: left pending; their output so far is written
                self.engine.abort_request(rid)
                self.tracker.pop(rid)
                self.telemetry.ended(rid, "left pending (drain)")
            if self.tracker.jobs or self.engine.has_unfinished_requests():
                log.warning("engine still holds requests after drain")
            self.stopped = True

    # ---- status ------------------------------------------------------------------------------
    def _status(self) -> WorkerStatus:
        stats = self.last_stats = self.engine.stats()
        return WorkerStatus(
            worker_id=self.worker_id, model=self.model_name, model_path=self.model_path,
            max_model_len=self.engine.max_model_len, block_size=self.engine.block_size,
            total_blocks=stats.total_blocks, free_blocks=stats.free_blocks, cached_blocks=stats.cached_blocks,
            promised_blocks=self.tracker.promised_blocks(self.engine.block_size,
                                                         self.settings.route_max_output_tokens), running=stats.num_running, waiting=stats.num_waiting,
            num_preemptions=stats.num_preemptions, num_finished=self.num_finished, pid=os.getpid(), host=socket.gethostname(),
            started_at=self.started_at, draining=self.draining, **self.metrics.recent())

    def _compute_room(self) -> Room:
        s, backlog = self.status, self.status.waiting + self.inbox.qsize()
        spare = (not self.draining and backlog == 0
                 and s.available_blocks() > self.settings.reserve_blocks)
        return Room(own_backlog=not self.draining and backlog < self.max_backlog, spare=spare,
                    draining=self.draining, accounted=self.jobs_seen, total_blocks=s.total_blocks,
                    available_blocks=s.available_blocks(), block_size=s.block_size,
                    idle=not self.tracker.jobs and backlog == 0)

    def live(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self.last_tick
        return (stalled < 300, f"main loop last ran {stalled:.1f}s ago")

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.outbox is None or not self.outbox.healthy:
            return False, "redis unreachable"
        return True, "ok"


def _scheduling_policy(spec: str) -> str:
    """--scheduling-policy: a user's class is imported while the flags are parsed, so a wrong name fails at once."""
    try:
        policy_class(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (redis://, rediss://, with password); env KVFLEET_REDIS_URL")
    p.add_argument("--model", help="HF directory, .gguf file or the default alias; env KVFLEET_MODEL")
    p.add_argument("--served-model-name", help="the name clients use (default: the engine's model name)")
    p.add_argument("--worker-id", help="stable id (its stream is kvfleet:req:ID); default host-pid")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks")
    p.add_argument("--kv-cache-memory", help="KV cache size in memory, e.g. 2GiB (instead of --num-kv-blocks)")
    p.add_argument("--block-size", type=int, default=16, help='tokens per KV-cache block')
    p.add_argument("--max-num-seqs", type=int, default=128, help='most sequences in one batch')
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help='token budget of one engine step (prefill chunks + decodes)')
    p.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    p.add_argument("--scheduling-policy", type=_scheduling_policy, default="fcfs", metavar="POLICY",
                   help="which waiting request is admitted next and which running one is preempted first: fcfs "
                        "(first come, first served), priority (lower value first), sjf (fewest tokens first, with "
                        "aging) or package.module:Class (a gpu_worker.core.policies.SchedulingPolicy subclass)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help='turn off automatic prefix caching')
    p.add_argument("--dtype", default="float32", help='weights and KV cache dtype: float32, bfloat16 or float16')
    p.add_argument("--device", default="cpu", help='cpu or cuda')
    p.add_argument("--seed", type=int, default=0, help='seed for requests that give none')
    p.add_argument("--log-memory-usage", type=float, default=0.0, metavar="SECONDS",
                   help="log the KV cache's blocks used / free / cached, fragmentation and preemptions every "
                        "SECONDS (0: off)")
    p.add_argument("--metrics-port", type=int, help="serve /livez, /readyz, /metrics on this port")
    p.add_argument("--metrics-host", help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 in pods; env "
                                          "KVFLEET_METRICS_HOST)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--status-ttl", type=float, help="seconds a status lives without a heartbeat")
    p.add_argument("--max-deliveries", type=int, help="deliveries before a request goes to kvfleet:dead")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hf_offline()
    telemetry.setup_tracing("kvfleet-worker")
    settings = Settings.from_env(redis_url=args.redis_url, model=args.model, worker_id=args.worker_id,
                                 status_ttl_s=args.status_ttl, max_deliveries=args.max_deliveries,
                                 metrics_host=args.metrics_host)
    keys.validate_worker_id(settings.worker_id)
    from gpu_worker.engine.llm_engine import LLMEngine
    from shared.models import resolve_model

    worker: Worker | None = None  # the probes answer while the model loads: alive, not ready
    health = None
    if args.metrics_port is not None:
        from gpu_worker.serve.health_server import HealthServer

        health = HealthServer(args.metrics_port, lambda: worker.live() if worker else (True, "loading the model"),
                              lambda: worker.ready() if worker else (False, "loading the model"),
                              host=settings.metrics_host).start()
    try:
        engine = LLMEngine.from_model(
            settings.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy, seed=args.seed,
            log_memory_usage_s=args.log_memory_usage)
        worker = Worker(engine, settings, model_name=args.served_model_name or engine.model_name,
                        model_path=str(resolve_model(settings.model)), drain_timeout_s=args.drain_timeout,
                        max_backlog=args.max_num_seqs)
        if health:
            health.registry = worker.metrics.registry
        return worker.run()
    finally:
        if health:
            health.stop()
        telemetry.shutdown()
