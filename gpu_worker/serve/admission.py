"""One delivered request entry, judged before the engine sees it: handed to the worker's main thread as a Job,
or closed here (gpu_worker.serve.entry_closer) when running it is not the right answer.

The reader threads (gpu_worker.serve.intake) call `take` for every entry they read or claim, and the worker
trusts no producer, so each entry is checked in this order:
- it must parse (fields, types, JSON) and carry this worker's schema version (shared.messages.SCHEMA_VERSION),
  and its sampling parameters must be valid: else it is dead-lettered with the reason (`invalid_request`);
- a gateway's request delivered again (claimed from a dead worker) goes back to its gateway, which places it
  again; any other one resumes from the output already written (its stream continues where it stopped);
- a request already finished is acked; one delivered more than `max_deliveries` times is dead-lettered; one
  cancelled meanwhile is finished as aborted; one this worker's whole KV cache cannot hold is forwarded to a
  live worker with room that can;
- a request with structured outputs has its grammar compiled here, on the reader thread, before the main thread
  takes it: a large schema compiles for up to a few seconds, and the engine's step loop must not wait (the
  compile releases the GIL). A spec that does not compile is left to the main thread, which fails the request.
An error that is not Redis's is that entry's fault: it is dead-lettered, so it can stop neither the reader nor the
stream. A Redis error leaves the entry pending here, untaken, for the reader's next turn to claim back.

It remembers the delivery count it last took each entry with (`latest`), so that a refusal of an older
delivery, reported by a later flush too, does not claim that entry once more (each claim counts toward
`max_deliveries`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gpu_worker.serve.entry_closer import EntryCloser
from gpu_worker.serve.request_tracker import Job
from shared import streams
from shared.messages import SCHEMA_VERSION, ErrorKind
from shared.settings import Settings

log = logging.getLogger("kvfleet.worker")

LATEST_KEPT = 4096  # entries whose latest delivery count it remembers (to ignore refusals of older ones)


class Admission:
    def __init__(self, r: streams.Client, settings: Settings, shard: int, inbox: queue.Queue, room: Callable[[], Any],
                 closer: EntryCloser, precompile: Any = None):
        """inbox: the main thread's; room: what the main thread last saw of its engine (gpu_worker.serve.intake.Room:
        block_size, total_blocks are read here); closer: closes the entries it does not hand over."""
        self.r, self.settings, self.shard = r, settings, shard
        self.inbox, self.room, self.closer = inbox, room, closer
        self.precompile = precompile  # gpu_worker.engine.structured.Grammars, or None
        # entry (stream, id) -> the delivery count it last took it with (read, claimed at start or claimed back)
        self.latest: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.handed = 0  # jobs put into the inbox; the reader's `spare` is stale until the main thread accounted them
        # requests whose entry it took and closed itself (dead-lettered, forwarded, finished, handed back to their
        # gateway): the worker's next status drops their reservations, as it does for those it runs
        self.settled: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._compiling = threading.local()  # .s: seconds a reader thread spent compiling grammars

    def taken_on(self, stream: str) -> set[str]:
        """The entry ids of `stream` it took (as far as it remembers)."""
        return {entry_id for s, entry_id in self.latest if s == stream}

    def taken_since(self, ack: streams.Ack) -> bool:
        """Was the entry of `ack` taken again, with a later delivery, since that one?"""
        return self.latest.get((ack.stream, ack.entry_id), 0) > ack.deliveries

    def compile_seconds(self) -> float:
        """Seconds this thread spent compiling grammars since the last call (a long compile is not Redis hanging)."""
        seconds, self._compiling.s = getattr(self._compiling, "s", 0.0), 0.0
        return seconds

    def take(self, d: streams.Delivery, first_run: bool = False) -> None:
        """Hand one delivery to the main thread, or close it here. `first_run`: a delivery count over 1 that only
        counts a read whose reply was lost (nobody ran the request before)."""
        self.latest[(d.stream, d.entry_id)] = d.deliveries
        self.latest.move_to_end((d.stream, d.entry_id))
        if len(self.latest) > LATEST_KEPT:
            self.latest.popitem(last=False)
        try:
            request = streams.parse_request(d.fields)
        except (KeyError, TypeError, ValueError) as e:
            self.closer.drop_malformed(d, f"malformed request entry: {type(e).__name__}: {e}")
            return
        job = Job(request=request, stream=d.stream, entry_id=d.entry_id, deliveries=d.deliveries)
        handed = self.handed
        try:
            self._judge(job, d, first_run)
        except streams.RedisError:
            self.latest.pop((d.stream, d.entry_id), None)
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("request %s cannot be taken", job.request_id)
            kind: ErrorKind = "invalid_request" if isinstance(e, TypeError | ValueError) else "internal"
            self.closer.dead_letter(job, f"{type(e).__name__}: {e}", kind=kind)
        if self.handed == handed:  # closed here, not handed to the main thread (a Redis error left it pending)
            self.settled.put(job.request_id)

    def _judge(self, job: Job, d: streams.Delivery, first_run: bool) -> None:
        request = job.request
        if request.v != SCHEMA_VERSION:
            self.closer.dead_letter(job, f"schema version v={request.v}; this worker reads v={SCHEMA_VERSION}",
                                    kind="invalid_request")
            return
        try:
            params = request.params()
        except (TypeError, ValueError) as e:
            self.closer.dead_letter(job, f"invalid sampling_params: {e}", kind="invalid_request")
            return
        if d.deliveries > 1 and request.reply_to and not first_run:
            self.closer.back_to_gateway(job)
            return
        if d.deliveries > 1 or request.attempt > 0:
            job.resume_from(streams.read_all_chunks(self.r, request.request_id, self.shard))
        if job.done:
            streams.ack_and_delete(self.r, d.ack)
            return
        if d.deliveries > self.settings.max_deliveries:
            self.closer.dead_letter(job, f"delivered {d.deliveries} times (max_deliveries "
                                         f"{self.settings.max_deliveries})")
            return
        if streams.is_cancelled(self.r, request.request_id):
            self.closer.finish(job, finish_reason="abort")
            return
        room = self.room()
        longest = len(request.prompt_token_ids) + max((len(t) for t in job.sent_tokens), default=0)
        need = -(-longest // room.block_size)
        if room.total_blocks and need > room.total_blocks:
            self.closer.forward(job, need)
            return
        spec = params.structured_outputs
        if spec is not None and self.precompile is not None:
            began = time.monotonic()
            try:
                self.precompile.compile(spec)
            except Exception:  # noqa: BLE001 (the main thread's add_request fails the request with the reason)
                pass
            self._compiling.s = getattr(self._compiling, "s", 0.0) + time.monotonic() - began
        self.handed += 1
        self.inbox.put(job)
