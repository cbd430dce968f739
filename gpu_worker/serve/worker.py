"""Run one engine worker that serves its Redis stream (`kvfleet worker`).

The engine runs in the main thread; two reader threads (gpu_worker.serve.intake) feed it Jobs and cancels
through a queue, and one writer thread (gpu_worker.serve.outbox) writes output chunks, acks and the status.
SIGTERM drains: take nothing new, hand back what has not started, finish the rest within --drain-timeout,
leave what is still unfinished pending (another worker claims it and continues), and exit.

Faults stay local. A request the engine fails (finish_reason "error") or cannot take gets its error chunk and
goes to kvfleet:dead; the rest carry on. The main loop survives unexpected errors (logged, retried after a
backoff); it ends with exit status 1, so the supervisor restarts the worker and others take over what it
held, only when the engine is broken (EngineFault), errors come MAX_TICK_FAILURES times in a row, or a
reader or writer thread died; and with exit status 1 from its watchdog when the main loop hangs
(gpu_worker.serve.watchdog). Until then, and after, /readyz says why it is not ready. A request another
worker took over (this one was paused past its status TTL) is aborted here once the outbox's writes for it
are refused: it frees its blocks, and the worker carries on. So is one whose gateway's lease lapsed (the
gateway died mid-stream): the intake cancels it, finish_reason "abort".
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import time
import uuid
from collections import OrderedDict
from typing import Any

from gpu_worker.serve.entry_closer import requeue
from gpu_worker.serve.intake import Cancel, Intake, Room
from gpu_worker.serve.metrics import WorkerMetrics
from gpu_worker.serve.outbox import Outbox
from gpu_worker.serve.request_telemetry import RequestTelemetry
from gpu_worker.serve.request_tracker import Job, RequestTracker
from gpu_worker.serve.watchdog import StallWatchdog
from shared import keys, streams
from shared.messages import ChunkError, DeadLetter, ErrorKind, WorkerStatus
from shared.settings import Settings, redacted_url

log = logging.getLogger("kvfleet.worker")

MAX_TICK_FAILURES = 5  # main-loop errors in a row after which the worker gives up (exit 1, restarted)


class Worker:
    def __init__(self, engine: Any, settings: Settings, *, model_name: str, model_path: str = "",
                 drain_timeout_s: float = 30.0, max_backlog: int | None = None, simulated: str | None = None,
                 step_log: Any = None):
        self.engine, self.settings = engine, settings
        self.simulated = simulated  # the cost profile's name of a simulated worker (`kvfleet worker --simulate`)
        self.step_log = step_log  # a gpu_worker.serve.step_log.StepLog (`--step-log`), or None
        self.worker_id = keys.validate_worker_id(settings.worker_id)
        self.model_name, self.model_path = model_name, model_path
        self.drain_timeout_s = drain_timeout_s
        self.max_backlog = max_backlog or 32
        self.tracker = RequestTracker(self.worker_id)
        self.inbox: queue.Queue = queue.Queue()
        self.cancelled: OrderedDict[str, None] = OrderedDict()  # cancels that came before their request
        self.taken: list[str] = []  # requests taken since the last status: their reservations can go
        self.draining, self.drain_deadline, self.stopped = False, 0.0, False
        self._room = Room()
        self.num_finished = 0
        self.jobs_seen = 0  # jobs taken from the inbox (the intake compares it with the jobs it handed over)
        self.outbox: Outbox | None = None
        self.intake: Intake | None = None
        self.broken: str | None = None  # why the worker stopped serving (it is then not ready, not live)
        self.last_tick = time.monotonic()
        self.started_at = time.time()
        self.run_id = uuid.uuid4().hex  # this run's, in its status: the outbox's fence (shared.streams.publish)
        self.last_stats: Any = None  # the scheduler's stats at the last tick (metrics read it at scrape time)
        self.metrics = WorkerMetrics(model_name, self.worker_id, lambda: self.last_stats)
        self.telemetry = RequestTelemetry(self.worker_id, engine, self.metrics)
        self.status = self._status()

    # ---- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        r = streams.connect(self.settings.redis_url, health_check_interval=30)
        self.outbox = Outbox(r, self.settings, self.worker_id, self.run_id, held=self._held).start()
        self.outbox.set_status(self.status)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # the reader threads' own client: their reads and claims are never sent twice (streams.NO_RESEND)
        reader_r = streams.connect(self.settings.redis_url, resend=False, health_check_interval=30)
        self.intake = Intake(reader_r, self.settings, self.worker_id, self.inbox, lambda: self._room,
                             metrics=self.metrics, on_regroup=self.outbox.republish, leased=self._leased,
                             writes_refused=lambda: bool(self.outbox.refused),
                             precompile=getattr(self.engine, "grammars", None))
        self.intake.start(lambda: self.draining)  # (not ready while it waits for Redis: intake.redis_failing)
        self.last_tick = time.monotonic()
        StallWatchdog(self.worker_id, lambda: self.last_tick, self.settings.engine_stall_s,
                      on_stall=lambda: self.outbox.close(timeout_s=2.0)).start()
        if not self.draining:  # (a signal while it waited for Redis at start: it took nothing, and stops)
            log.info("worker %s serving %s on %s", self.worker_id, self.model_name,
                     redacted_url(self.settings.redis_url))
        try:
            self._loop()
        finally:
            self.intake.stop()
            self.outbox.close()
        log.info("worker %s stopped", self.worker_id)
        return 1 if self.broken else 0

    def _loop(self) -> None:
        from gpu_worker.engine.isolation import EngineFault

        failures = 0
        while not self.stopped and not self.broken:
            try:
                self.tick()
                failures = 0
            except EngineFault as e:
                self._give_up(f"the engine is broken: {e}")
            except Exception as e:  # noqa: BLE001 (the main loop must not die)
                failures += 1
                log.exception("unexpected error in the main loop (%d in a row)", failures)
                if failures >= MAX_TICK_FAILURES:
                    self._give_up(f"{failures} main-loop errors in a row, the last: {type(e).__name__}: {e}")
                time.sleep(min(0.1 * 2 ** (failures - 1), 5.0))
            if dead := self._dead_threads():
                self._give_up(f"thread(s) {', '.join(dead)} died")
            elif not self.broken and (fault := self.engine.fault()):
                self._give_up(f"the engine is broken: {fault}")

    def _give_up(self, reason: str) -> None:
        log.critical("worker %s stops serving: %s; what it holds stays pending for another worker",
                     self.worker_id, reason)
        self.broken = reason

    def _dead_threads(self) -> list[str]:
        dead = self.intake.dead_threads() if self.intake is not None else []
        return dead + ([] if self.outbox is None or self.outbox.alive else ["kvfleet-outbox"])

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
        self._drop_lost()
        if self.draining:
            self._drain_step()
        outputs = None
        if self.engine.has_unfinished_requests() and not self.stopped:
            began = time.perf_counter()
            outputs = self.engine.step()
            if self.step_log is not None:
                self.step_log.step(time.perf_counter() - began)
        with self.outbox.gathered():  # the step's output and the status after it: one item for the writer
            if outputs is not None:
                for output in outputs:
                    self._emit(output)
                self.telemetry.after_step()
            self.status = self._status()
            self._room = self._compute_room()
            if self.intake is not None:
                while not self.intake.settled.empty():
                    self.taken.append(self.intake.settled.get_nowait())
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
                    self.outbox.hand_back(requeue(item.request), item.ack)
                else:
                    self.jobs_seen += 1
                    self._add(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, job: Job) -> None:
        from gpu_worker.engine.llm_engine import InvalidRequest, RequestRejected

        rid = job.request_id
        self.taken.append(rid)  # however it ends here, its reservation goes with the next status
        if rid in self.tracker:  # the same request enqueued twice: its output stream is already being written
            log.warning("request %s is already running here; acking the duplicate entry", rid)
            self.outbox.send([], job.ack)
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
        except InvalidRequest as e:
            self._fail(job, str(e), kind="invalid_request")
            return
        except RequestRejected as e:  # it does not fit this worker
            if job.stream != keys.req_stream(self.worker_id, self.settings.worker_shard) and req.attempt + 1 < self.settings.max_deliveries:
                self.tracker.pop(rid)  # another worker may have the room this one lacks
                self.telemetry.ended(rid, f"handed back: {e}")
                self.outbox.hand_back(requeue(req), job.ack)
                return
            self._close(job, error=ChunkError(kind="invalid_request", message=str(e)))
            return
        except Exception as e:  # noqa: BLE001 (this request's fault, whatever it is)
            log.exception("request %s could not be added", rid)
            self.engine.abort_request(rid)
            self._fail(job, f"{type(e).__name__}: {e}",
                       kind="invalid_request" if isinstance(e, TypeError | ValueError) else "internal")
            return

    def _drop_lost(self) -> None:
        """Abort the requests another worker took over (this one was paused or cut off past the status TTL):
        the outbox's writes for them were refused, so they end here without a word and free their blocks."""
        while not self.outbox.lost.empty():
            rid, ack = self.outbox.lost.get_nowait()
            if self.tracker.pop(rid) is not None:
                log.warning("request %s was taken over by another worker: aborted here", rid)
                self.engine.abort_request(rid)
                self.telemetry.ended(rid, "taken over by another worker")
            self.intake.recheck(ack)  # even when it had finished here: its final chunk and ack were refused

    def _held(self) -> dict[str, streams.Ack]:
        """Request id -> delivery of every request it holds (called from the outbox thread: the copy is atomic)."""
        return {rid: job.ack for rid, job in self.tracker.jobs.copy().items()}

    def _leased(self) -> list[str]:
        """The requests it holds whose gateway holds a lease (called from the cancel thread: the copy is atomic)."""
        return [rid for rid, job in self.tracker.jobs.copy().items() if job.request.lease]

    def _cancel(self, request_id: str) -> None:
        job = self.tracker.jobs.get(request_id)
        if job is None:
            self.cancelled[request_id] = None
            while len(self.cancelled) > 4096:
                self.cancelled.popitem(last=False)
            return
        self.engine.abort_request(request_id)
        self._close(job, finish_reason="abort")

    def _close(self, job: Job, dead_letter: DeadLetter | None = None, **final: Any) -> None:
        self.tracker.pop(job.request_id)
        error = final.get("error")
        self.telemetry.ended(job.request_id, final.get("finish_reason") or "error",
                             error=error.message if error else None)
        self.outbox.send([self.tracker.final_chunk(job, **final)], job.ack, dead_letter,
                         reply_to=job.request.reply_to)

    def _dead_letter(self, job: Job, reason: str) -> DeadLetter:
        log.error("request %s -> %s: %s", job.request_id, keys.DEAD, reason)
        self.metrics.dead_letters.inc()
        return DeadLetter(request=job.request, reason=reason, deliveries=job.deliveries, worker_id=self.worker_id)

    def _fail(self, job: Job, reason: str, kind: ErrorKind = "internal") -> None:
        """Close a request that failed here: its error chunk, and a dead letter (no other worker gets it)."""
        message = reason if kind == "invalid_request" else f"request failed: {reason}"
        self._close(job, self._dead_letter(job, reason), error=ChunkError(kind=kind, message=message),
                    finish_reason="error")

    # ---- output ------------------------------------------------------------------------------
    def _emit(self, output: Any) -> None:
        job = self.tracker.jobs.get(output.request_id)
        if job is None:
            return  # aborted meanwhile
        try:
            first = output.request_id not in self.tracker.started
            chunks = self.tracker.chunks_for(output)
            self.telemetry.output(job, output, chunks, first=first)
        except Exception as e:  # noqa: BLE001 (this request's output: it alone fails)
            log.exception("the output of request %s could not be sent", job.request_id)
            self.engine.abort_request(job.request_id)
            self._fail(job, f"its output could not be built: {type(e).__name__}: {e}")
            return
        if output.finished:
            self.num_finished += output.error is None
            self.tracker.pop(job.request_id)
            letter = self._dead_letter(job, output.error) if output.error is not None else None
            self.outbox.send(chunks, job.ack, letter, reply_to=job.request.reply_to)
        elif chunks:
            self.outbox.send(chunks, owner=job.ack, reply_to=job.request.reply_to)

    # ---- drain -------------------------------------------------------------------------------
    def _drain_step(self) -> None:
        for rid, job in list(self.tracker.jobs.items()):  # not started yet: back to the fleet at once
            if rid not in self.tracker.started:
                self.engine.abort_request(rid)
                self.tracker.pop(rid)
                self.telemetry.ended(rid, "handed back (drain)")
                self.outbox.hand_back(requeue(job.request), job.ack)
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
            started_at=self.started_at, run_id=self.run_id, shard=self.settings.worker_shard, draining=self.draining, restarts=self.settings.restarts,
            simulated=self.simulated,
            **self.metrics.recent())

    def _compute_room(self) -> Room:
        s, backlog = self.status, self.status.waiting + self.inbox.qsize()
        spare = (not self.draining and backlog == 0
                 and s.available_blocks() > self.settings.reserve_blocks)
        return Room(own_backlog=not self.draining and backlog < self.max_backlog, spare=spare,
                    draining=self.draining, accounted=self.jobs_seen, total_blocks=s.total_blocks,
                    available_blocks=s.available_blocks(), block_size=s.block_size,
                    idle=not self.tracker.jobs and backlog == 0,
                    free_seqs=max(0, self.max_backlog - s.running - backlog))

    def live(self) -> tuple[bool, str]:
        if self.broken:
            return False, self.broken
        stalled = time.monotonic() - self.last_tick
        limit = self.settings.engine_stall_s
        return (limit <= 0 or stalled < limit, f"main loop last ran {stalled:.1f}s ago")

    def ready(self) -> tuple[bool, str]:
        if self.broken or (dead := self._dead_threads()):
            return False, self.broken or f"thread(s) {', '.join(dead)} died"
        if self.draining:
            return False, "draining"
        if self.outbox is not None and self.outbox.refused == "full":
            return False, "redis is full (maxmemory): its writes wait"
        if self.outbox is not None and self.outbox.refused:
            return False, "redis cannot persist (MISCONF: its disk?): its writes wait"
        if self.outbox is None or not self.outbox.healthy:
            return False, "redis unreachable"
        if self.intake is not None and self.intake.redis_failing:
            return False, f"redis unreachable ({', '.join(sorted(self.intake.redis_failing))} failing)"
        return True, "ok"
