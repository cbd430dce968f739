"""Wire messages: what travels through Redis between gateways, workers and clients (pydantic, JSON).

GenerationRequest  gateway/Celery/client -> kvfleet:req:{worker} or kvfleet:req:any
OutputChunk        worker -> kvfleet:out:{request_id}, or batched per flush into kvfleet:inbox:{gateway} (the
                   request's reply_to); numbered by `seq` so a reader drops repeats
WorkerStatus       worker -> kvfleet:status:{worker} (with a TTL)
DeadLetter         worker -> kvfleet:dead
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from shared.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]  # "error": the request failed (the chunk's `error` says why)
# What went wrong, when a chunk carries an error: the gateway maps it to an HTTP status.
# "worker_lost": the worker that ran a gateway's request died; another one took the entry over and tells the
# gateway, which places the request again with the chunks it relayed (a worker cannot read a gateway's inbox).
ErrorKind = Literal["invalid_request", "dead_letter", "internal", "worker_lost"]


SCHEMA_VERSION = 1  # of GenerationRequest: a worker dead-letters a request of a version it does not speak
LOGPROB_FLOOR = -9999.0  # stands for -inf and NaN logprobs (OpenAI's value for "very unlikely"): JSON has no inf


class GenerationRequest(BaseModel):
    v: int = SCHEMA_VERSION
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)  # SamplingParams.to_dict()
    model: str = ""
    priority: int = 0
    prompt: str | None = None  # the text, when the caller had one (echo, tracing)
    arrival_time: float = Field(default_factory=time.time)  # wall clock, seconds
    # W3C trace context (traceparent, tracestate) injected by the caller's tracer; empty when off.
    trace_context: dict[str, str] = Field(default_factory=dict)
    attempt: int = 0  # times it was re-enqueued: by a worker, or by a gateway after Redis lost it (Redis counts deliveries)
    kv_blocks: int = 0  # blocks the router counted for it (its reservation); 0 when unrouted
    # The gateway holds kvfleet:{s}:lease:{request_id} while its client waits: a worker aborts the request once
    # the lease lapsed. False (services' jobs, older producers): it runs to the end whoever reads it.
    lease: bool = False
    # The gateway (its id) whose inbox its output goes to, batched with that gateway's other requests
    # (kvfleet:{s}:inbox:{gateway}, in the shard of the worker that runs it); None: its own
    # kvfleet:{s}:out:{request_id}, which any reader can follow and a worker taking it over resumes from.
    reply_to: str | None = None

    def params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling_params)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


class ChunkError(BaseModel):
    kind: ErrorKind
    message: str


class OutputChunk(BaseModel):
    """A step's worth of output for one choice of one request. `seq` counts chunks of the request from 0
    across all choices; a request's last chunk has `final` set (and `usage`, or `error`)."""

    request_id: str
    seq: int
    index: int = 0  # which of the n choices
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""  # text delta
    logprobs: list[dict[int, float]] | None = None  # one dict per token: chosen + top-k token id -> logprob
    # once per request, in its first chunk with tokens (any choice's; every choice's prompt), when prompt_logprobs
    # was asked: one dict per prompt token (its logprob given what precedes it + the top-k there), the first None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank there (1: the likeliest)
    finish_reason: FinishReason | None = None  # this choice finished
    stop_reason: int | str | None = None
    final: bool = False  # the request finished: nothing follows
    usage: Usage | None = None
    error: ChunkError | None = None
    worker_id: str = ""
    # The owner token of the writer, with worker_id: the request's re-enqueue count and the delivery count of
    # its stream entry when that worker took it. Readers drop chunks with a token older than one already seen.
    attempt: int = 0
    delivery: int = 0

    def owner_token(self) -> tuple[int, int]:
        return self.attempt, self.delivery


    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _finite_logprobs(cls, v: list[dict[int, float] | None] | None) -> list[dict[int, float] | None] | None:
        """-inf / NaN would be written as null and make the chunk unreadable: LOGPROB_FLOOR instead."""
        if v is None or all(math.isfinite(x) for d in v if d is not None for x in d.values()):
            return v
        return [None if d is None else {t: x if math.isfinite(x) else (0.0 if x > 0 else LOGPROB_FLOOR)
                                        for t, x in d.items()} for d in v]


class WorkerStatus(BaseModel):
    worker_id: str
    model: str
    model_path: str = ""  # where the worker loaded it from (the gateway loads its tokenizer from there)
    max_model_len: int
    block_size: int
    total_blocks: int
    free_blocks: int
    # blocks the requests it holds will still claim: not-yet-started ones in full, running ones until they
    # reach their max_tokens (capped as the router caps it); free - promised is what it can still take
    promised_blocks: int = 0
    running: int = 0
    waiting: int = 0
    num_preemptions: int = 0
    num_finished: int = 0  # requests this worker completed (its output's final chunk written)
    generation_tokens: int = 0  # output tokens generated since start (refreshed every ~0.5 s; `kvfleet top`)
    ttft_p50_s: float | None = None  # time to first token over its last 256 requests (gpu_worker.serve.metrics)
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    cached_blocks: int = 0
    pid: int = 0
    host: str = ""
    started_at: float = 0.0
    # A fresh id for each run of the worker: its flushes skip the per-request ownership checks while the status
    # in Redis is still this run's (shared.streams.publish); it is not, once the status expired or was taken over.
    run_id: str = ""
    shard: int = 0  # the shard its streams and keys are in (shared.keys); requests placed on it go there
    heartbeat: float = Field(default_factory=time.time)
    draining: bool = False
    restarts: int = 0  # times its supervisor (`kvfleet up`) started it again after it exited
    simulated: str | None = None  # a simulated worker's cost profile (`kvfleet worker --simulate`); None: a real model

    def available_blocks(self) -> int:
        """Free blocks not already promised to requests this worker holds."""
        return self.free_blocks - self.promised_blocks

    def same_state(self, other: WorkerStatus | None) -> bool:
        """Equal but for the heartbeat: publishing it again would tell nobody anything new."""
        if other is None:
            return False
        return self.model_dump(exclude={"heartbeat"}) == other.model_dump(exclude={"heartbeat"})


DEAD_LETTER_RAW_CHARS = 4096  # of a malformed entry's fields kept in its dead letter (an entry may be any size)
DEAD_LETTER_REASON_CHARS = 2000


def _capped(text: str | None, limit: int) -> str | None:
    """At most `limit` characters and a note of how many more there were (read back, a capped text fits the
    64 characters of room left for that note, so it is not cut twice)."""
    if text is None or len(text) <= limit + 64:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters not kept)"


class DeadLetter(BaseModel):
    """A request no worker could finish, kept in the capped kvfleet:dead stream. Bounded: a request the
    gateway or a client validated (its prompt within max_model_len), or at most DEAD_LETTER_RAW_CHARS of a
    malformed entry, and a reason of at most DEAD_LETTER_REASON_CHARS."""

    request: GenerationRequest | None = None  # None: the entry could not be read as one (see `raw`)
    reason: str
    deliveries: int
    worker_id: str
    time: float = Field(default_factory=time.time)
    raw: str | None = None  # a malformed entry's fields as received (JSON), when `request` is None

    @field_validator("raw")
    @classmethod
    def _cap_raw(cls, v: str | None) -> str | None:
        return _capped(v, DEAD_LETTER_RAW_CHARS)

    @field_validator("reason")
    @classmethod
    def _cap_reason(cls, v: str) -> str:
        return _capped(v, DEAD_LETTER_REASON_CHARS)
