"""What a worker records about each request, at its boundaries only: taken from the stream, first output
(admission, prefill done, first token), finished or ended otherwise. Spans go through shared.telemetry
(a no-op when tracing is off), numbers into gpu_worker.serve.metrics.

The request's span (`kvfleet.worker.request`, CONSUMER) is a child of the gateway's enqueue span, whose
context travels in the stream entry (GenerationRequest.trace_context); a request another worker takes over
after a crash gets a new span under the same parent, so it stays in the same trace. Its children are made
after the fact from the engine's timestamps (RequestMetrics), never per step:

  kvfleet.worker.request   taken -> finished          gen_ai.* request/usage attributes, kvfleet.* ones
    kvfleet.queue_wait     taken -> first scheduled   kvfleet.queue.wait_s (from the gateway's enqueue)
    kvfleet.prefill        first scheduled -> first token   kvfleet.kv.blocks, kvfleet.prefix_cache.hit_tokens
    kvfleet.decode         first token -> finished    gen_ai.usage.output_tokens
  events: admitted, first_token (kvfleet.ttft_s), preempted (checked once per step against one counter)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, SpanKind

from gpu_worker.serve.metrics import WorkerMetrics
from shared import telemetry as t


@dataclass
class _Open:
    span: Span
    taken_ns: int
    first_token_ns: int | None = None
    preemptions: dict[str, int] = field(default_factory=dict)  # scheduler request id -> seen


class RequestTelemetry:
    def __init__(self, worker_id: str, engine: Any, metrics: WorkerMetrics):
        self.worker_id, self.engine, self.metrics = worker_id, engine, metrics
        self.open: dict[str, _Open] = {}
        self.resumed: dict[str, int] = {}  # requests taken over with tokens already sent -> how many
        self.generated: dict[str, int] = {}  # request -> tokens this worker sent for it so far
        self._preemptions_seen = 0

    # ---- boundaries (worker main thread) -----------------------------------------------------------------
    def taken(self, job: Any) -> None:
        """The worker took `job` (gpu_worker.serve.request_tracker.Job) from its stream."""
        resumed = sum(len(x) for x in job.sent_tokens)
        if job.deliveries > 1 or job.request.attempt > 0:
            self.metrics.redeliveries.inc()
        if resumed:
            self.resumed[job.request_id] = resumed
        if not t.enabled():
            return
        req, sp = job.request, job.request.sampling_params
        span = t.start_span("kvfleet.worker.request", context=t.extract(req.trace_context), kind=SpanKind.CONSUMER,
                            attributes={
                                t.GEN_AI_SYSTEM: t.SYSTEM, t.GEN_AI_REQUEST_MODEL: req.model,
                                t.GEN_AI_REQUEST_MAX_TOKENS: sp.get("max_tokens"),
                                t.GEN_AI_REQUEST_TEMPERATURE: sp.get("temperature"),
                                t.GEN_AI_REQUEST_TOP_P: sp.get("top_p"), t.GEN_AI_REQUEST_TOP_K: sp.get("top_k"),
                                t.GEN_AI_REQUEST_SEED: sp.get("seed"), t.GEN_AI_REQUEST_CHOICE_COUNT: sp.get("n"),
                                t.GEN_AI_USAGE_INPUT_TOKENS: len(req.prompt_token_ids),
                                t.KVFLEET_REQUEST_ID: req.request_id, t.KVFLEET_WORKER_ID: self.worker_id,
                                t.MESSAGING_SYSTEM: "redis", t.MESSAGING_DESTINATION: job.stream,
                                t.KVFLEET_ATTEMPT: req.attempt, t.KVFLEET_DELIVERIES: job.deliveries,
                                t.KVFLEET_RESUMED_TOKENS: resumed})
        self.open[req.request_id] = _Open(span, time.time_ns())

    def output(self, job: Any, output: Any, chunks: list[Any], *, first: bool) -> None:
        """One engine output (a delta) of `job` and the chunks made from it; `first`: its first output here."""
        new = sum(len(c.token_ids) for c in chunks)
        self.metrics.generation_tokens += new
        self.generated[job.request_id] = self.generated.get(job.request_id, 0) + new
        if first:
            self._first_output(job, output)
        if output.finished:
            self._finished(job, output)

    def ended(self, request_id: str, reason: str, error: str | None = None) -> None:
        """The request left this worker outside the engine's finish: cancelled, rejected, handed back,
        left pending at drain."""
        self.resumed.pop(request_id, None)
        self.generated.pop(request_id, None)
        o = self.open.pop(request_id, None)
        if o is None:
            return
        o.span.set_attribute("kvfleet.end", reason)
        if error:
            t.set_error(o.span, error)
        o.span.end()

    def after_step(self) -> None:
        """Once per step: one int compare; on a new preemption, a `preempted` event on its request's span."""
        n = self.engine.scheduler.num_preemptions
        if n == self._preemptions_seen:
            return
        self._preemptions_seen = n
        if not self.open:
            return
        for req in list(self.engine.scheduler.requests.values()):
            rid = req.request_id if req.request_id in self.open else req.request_id.rpartition("-")[0]
            o = self.open.get(rid)
            if o is not None and req.num_preemptions > o.preemptions.get(req.request_id, 0):
                o.preemptions[req.request_id] = req.num_preemptions
                o.span.add_event("preempted", {"kvfleet.sequence": req.request_id,
                                               "kvfleet.preemptions": req.num_preemptions,
                                               "kvfleet.computed_tokens_lost": req.num_tokens})

    # ---- internals ---------------------------------------------------------------------------------------
    def _first_output(self, job: Any, output: Any) -> None:
        m = output.metrics
        ttft = None
        resumed = self.resumed.get(job.request_id, 0)
        if m is not None and m.first_token_time is not None and not resumed:
            ttft = m.first_token_time - m.arrival_time
        self.metrics.first_token(len(output.prompt_token_ids), ttft)
        o = self.open.get(job.request_id)
        if o is None or m is None or m.first_scheduled_time is None:
            return
        scheduled_ns = t.wall_ns(m.first_scheduled_time)
        first_ns = o.first_token_ns = scheduled_ns + int(((m.first_token_time or time.monotonic())
                                                          - m.first_scheduled_time) * 1e9)
        blocks = self._blocks(job, output)
        s = o.span
        queue_wait = m.first_scheduled_time - m.arrival_time
        s.set_attributes({t.KVFLEET_QUEUE_WAIT_S: queue_wait, t.KVFLEET_KV_BLOCKS: blocks,
                          t.KVFLEET_PREFIX_CACHE_HIT_TOKENS: m.num_cached_tokens})
        t.record_span("kvfleet.queue_wait", s, o.taken_ns, scheduled_ns, {t.KVFLEET_QUEUE_WAIT_S: queue_wait})
        s.add_event("admitted", {t.KVFLEET_KV_BLOCKS: blocks, t.KVFLEET_PREFIX_CACHE_HIT_TOKENS: m.num_cached_tokens},
                    timestamp=scheduled_ns)
        t.record_span("kvfleet.prefill", s, scheduled_ns, first_ns, {
            t.GEN_AI_USAGE_INPUT_TOKENS: len(output.prompt_token_ids), t.KVFLEET_KV_BLOCKS: blocks,
            t.KVFLEET_PREFIX_CACHE_HIT_TOKENS: m.num_cached_tokens,
            t.KVFLEET_RESUMED_TOKENS: resumed})
        if ttft is not None:
            s.set_attribute(t.KVFLEET_TTFT_S, ttft)
            s.add_event("first_token", {t.KVFLEET_TTFT_S: ttft}, timestamp=first_ns)

    def _finished(self, job: Any, output: Any) -> None:
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        o = self.open.pop(job.request_id, None)
        generated = self.generated.pop(job.request_id, 0)
        resumed = self.resumed.pop(job.request_id, 0)
        self.metrics.finished(output.metrics, generated, reasons)
        if o is None:
            return
        m = output.metrics
        end_ns = t.wall_ns(m.finished_time) if m and m.finished_time else time.time_ns()
        if o.first_token_ns is not None:
            t.record_span("kvfleet.decode", o.span, o.first_token_ns, end_ns,
                          {t.GEN_AI_USAGE_OUTPUT_TOKENS: generated})
        o.span.set_attributes({t.GEN_AI_USAGE_OUTPUT_TOKENS: resumed + generated,
                               t.GEN_AI_RESPONSE_FINISH_REASONS: reasons, "kvfleet.end": "finished"})
        o.span.end(end_time=end_ns)

    def _blocks(self, job: Any, output: Any) -> int:
        """KV blocks the request holds now (all its samples, shared ones once); when it already finished
        and freed them (a one-token request), the blocks its tokens filled."""
        kvm, n = self.engine.scheduler.kv_cache_manager, len(output.outputs)
        ids = [output.request_id] if n == 1 else [f"{output.request_id}-{i}" for i in range(n)]
        held = len({b for rid in ids for b in kvm.get_block_ids(rid)})
        if held or not output.finished:
            return held
        return max(kvm.num_blocks_for(len(output.prompt_token_ids) + len(t)) for t in job.sent_tokens)
