"""Closing a request entry the worker will not run. The intake's reader thread takes an entry and, instead of
handing it to the engine, fails it (dead-lettered with the reason: another schema version, invalid sampling
parameters, delivered past max_deliveries, or an error taking it), finishes it (cancelled before it started),
forwards it (its whole KV cache cannot hold it: to the shard's live worker whose cache can), or hands a gateway's
request taken over from a lost worker back to its gateway. Each writes the request's final chunk and acks the entry
in one fenced step (shared.streams.publish); a malformed entry, with no request to answer, is dead-lettered and
acked."""

from __future__ import annotations

import json
import logging
from typing import Any

from gpu_worker.serve.request_tracker import Job, RequestTracker
from shared import keys, streams, telemetry
from shared.messages import ChunkError, DeadLetter, ErrorKind, GenerationRequest
from shared.settings import Settings

log = logging.getLogger("kvfleet.worker")


class EntryCloser:
    def __init__(self, r: streams.Client, settings: Settings, worker_id: str, metrics: Any = None):
        self.r, self.settings, self.worker_id = r, settings, worker_id
        self.metrics = metrics  # gpu_worker.serve.metrics.WorkerMetrics: counts dead letters
        self.shard = settings.worker_shard

    def drop_malformed(self, d: streams.Delivery, reason: str) -> None:
        log.error("entry %s on %s -> %s: %s", d.entry_id, d.stream, keys.DEAD, reason)
        raw = json.dumps(d.fields)[:65536]
        streams.dead_letter(self.r, DeadLetter(reason=reason, deliveries=d.deliveries, worker_id=self.worker_id,
                                               raw=raw))
        streams.ack_and_delete(self.r, d.ack)
        if self.metrics is not None:
            self.metrics.dead_letters.inc()

    def forward(self, job: Job, need: int) -> None:
        """This worker's whole cache cannot hold the request (it came from the shared stream, or a dead
        worker's): pass it straight to the live worker of the shard with the largest cache that can, or fail it
        (a request never leaves its shard: its lease and output are there)."""
        able = [w for w in streams.other_workers(self.r, self.worker_id, self.shard).values()
                if w is not None and not w.draining and w.total_blocks >= need]
        if not able:
            self.finish(job, error=ChunkError(kind="invalid_request", message=(
                f"the request needs {need} KV blocks and no live worker's cache (of shard {self.shard}) holds "
                "that many")))
            return
        target = max(able, key=lambda w: (w.free_blocks, w.total_blocks)).worker_id
        log.info("request %s needs %d blocks > this cache: forwarded to %s", job.request_id, need, target)
        streams.forward(self.r, requeue(job.request), target, job.ack, self.shard)

    def back_to_gateway(self, job: Job) -> None:
        """A gateway's request taken over from a worker that died (or a drained one): its output so far is in
        that gateway's inbox, which only the gateway reads. Tell the gateway (a final `worker_lost` chunk): it
        places the request again with the chunks it relayed, so the worker that takes that one resumes after
        them. A gateway that is gone gets nothing, and the request ends here."""
        log.warning("request %s was taken over from a lost worker: handing it back to its gateway", job.request_id)
        self.finish(job, error=ChunkError(kind="worker_lost", message=(
            f"the worker running request {job.request_id} was lost; {self.worker_id} took its entry over")))

    def finish(self, job: Job, **kw) -> None:
        """Close a request that never reaches the engine: final chunk, then ack, in one step (fenced)."""
        tracker = RequestTracker(self.worker_id)
        tracker.add(job)
        chunk = tracker.final_chunk(job, **kw)
        rid, reply_to = job.request_id, job.request.reply_to
        streams.publish(self.r, self.worker_id, output_ttl_s=self.settings.output_ttl_s, chunks=[chunk],
                        acks=[job.ack], owners={rid: job.ack}, reply_to={rid: reply_to} if reply_to else None,
                        shard=self.shard)

    def dead_letter(self, job: Job, reason: str, kind: ErrorKind = "dead_letter") -> None:
        log.error("request %s -> %s: %s", job.request_id, keys.DEAD, reason)
        letter = DeadLetter(request=job.request, reason=reason, deliveries=job.deliveries, worker_id=self.worker_id)
        streams.dead_letter(self.r, letter)
        message = reason if kind == "invalid_request" else f"request failed: {reason}"
        self.finish(job, error=ChunkError(kind=kind, message=message))
        if self.metrics is not None:
            self.metrics.dead_letters.inc()
        span = telemetry.start_span("kvfleet.dead_letter", context=telemetry.extract(job.request.trace_context),
                                    attributes={telemetry.KVFLEET_WORKER_ID: self.worker_id,
                                                telemetry.KVFLEET_DELIVERIES: job.deliveries})
        telemetry.set_error(span, reason)
        span.end()


def requeue(request: GenerationRequest) -> GenerationRequest:
    """The copy a worker puts back on the shared stream when it hands a request back."""
    return request.model_copy(update={"attempt": request.attempt + 1, "kv_blocks": 0})
